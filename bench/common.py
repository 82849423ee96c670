"""What every bench script shares: the machine line, the docs/benchmarks.md sections they own, and
the plotting interpreter (matplotlib lives in bench/.venv-peers, so the project's .venv stays as
its lock file says)."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
RESULTS = ROOT / "bench" / "results"
PEERS_VENV = ROOT / "bench" / ".venv-peers"
PEERS_PY = PEERS_VENV / "bin" / "python"
PLOT_REQ = "matplotlib>=3.7"


def machine() -> str:
    model = "unknown CPU"
    cpuinfo = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        for line in cpuinfo.splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    virt = " (VM)" if "hypervisor" in cpuinfo else ""
    return f"{model}{virt}, {os.cpu_count()} cores{mem}, Linux {platform.release()}"


def git_rev(root: Path | str = ROOT) -> str:
    """A checkout's commit (this one's by default), and whether the code measured (pd_plugins/)
    differs from it; "?" where `root` is not a git checkout."""
    rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "pd_plugins"],
                           capture_output=True, text=True).stdout.strip()
    return rev + (", pd_plugins/ modified" if dirty else "")


def write_section(name: str, text: str) -> None:
    """Replace the `<!-- NAME:start -->`..`<!-- NAME:end -->` section of docs/benchmarks.md (text
    includes the markers), or append it."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    if DOC.exists():
        doc = DOC.read_text()
    else:
        doc = ("# Benchmarks\n\n"
               "Measurements of pd-plugins against the engines' own tooling. Each section below is "
               "written by a script under `bench/` (it replaces only its own section, between "
               "`<!-- NAME:start -->` and `<!-- NAME:end -->` markers) and says how to rerun it, "
               "on what machine, when, and with which versions.\n\n")
    if start in doc and end in doc:
        head, rest = doc.split(start, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        doc = head + text + ("\n" + tail if tail else "")
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    DOC.write_text(doc)


def plot_python() -> Path | None:
    """The interpreter with matplotlib (installed into bench/.venv-peers on first use), or None."""
    if PEERS_PY.exists() and subprocess.run([str(PEERS_PY), "-c", "import matplotlib"],
                                            capture_output=True).returncode == 0:
        return PEERS_PY
    if not PEERS_PY.exists():
        base = getattr(sys, "_base_executable", None) or "python3"
        if subprocess.run([base, "-m", "venv", str(PEERS_VENV)], capture_output=True).returncode:
            print("cannot create bench/.venv-peers: no plots", flush=True)
            return None
    print(f"pip install {PLOT_REQ} into bench/.venv-peers (for the plots)", flush=True)
    res = subprocess.run([str(PEERS_PY), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          PLOT_REQ], capture_output=True, text=True)
    if res.returncode != 0:
        print(f"could not install matplotlib; no plots:\n{res.stderr[-500:]}", flush=True)
        return None
    return PEERS_PY


def publish(section: str, text: str, plot_script: str, results: Path, plot_out: Path) -> None:
    """Write the docs section and draw its plot (bench/<plot_script> RESULTS PLOT_OUT, a PNG or
    the folder the script writes into, run with the plotting interpreter; skipped, with a
    message, where matplotlib cannot be installed)."""
    write_section(section, text)
    py = plot_python()
    if py is not None:
        subprocess.run([str(py), str(ROOT / "bench" / plot_script), str(results), str(plot_out)],
                       check=True)
    print(f"wrote {DOC.relative_to(ROOT)} and {plot_out.relative_to(ROOT)}")


def reference_proxy_args(doc: str) -> tuple[str, str, int]:
    """The command line of a reference proxy (naive_proxy.py, floor_proxy.py):
    PREFILL_URL DECODE_URL PORT, as bench/router_overhead.py starts them."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("prefill_url")
    ap.add_argument("decode_url")
    ap.add_argument("port", type=int)
    args = ap.parse_args()
    return args.prefill_url.rstrip("/"), args.decode_url.rstrip("/"), args.port


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """median (min to max) over repeats, each formatted with `fmt`; the one value alone. ("to", not
    a dash: the values may be negative.)"""
    if len(values) == 1:
        return fmt.format(values[0])
    return (f"{fmt.format(statistics.median(values))} "
            f"({fmt.format(min(values))} to {fmt.format(max(values))})")
