#!/usr/bin/env python
"""pd-router's instructions and simulated cache misses per PD request, under callgrind.

    .venv/bin/python -m bench.router_instructions      # this checkout and the floor proxy, ~4 min
    .venv/bin/python -m bench.router_instructions --tree before=/tmp/old
                            # an A/B: another checkout's router beside this one's (a git worktree)

Why: CPU time per request on this shared 2-core VM swings by 10-30% from one 4 s window to the
next (docs/benchmarks.md, "Router overhead"), so a change worth a few percent cannot be told from
noise there. valgrind's callgrind counts what the router's process executes, which does not
depend on the machine's load: the same code and the same requests give the same counts within
about 2%. It counts user-space instructions (Ir) and, with its cache simulation, the misses of a
32 KiB L1 instruction and data cache (I1mr, D1mr + D1mw) and of a 1 MiB L2 standing in for the
last level (LLmr + LLmw; the VM's caches are not modelled: what the kernel, the engines and other
tenants evict is not in these counts). The estimate callgrind's own docs use weighs them into
cycles: Ir + 10 x L1 misses + 100 x LL misses. Measured per case: a router alone on core 0
under valgrind, the mock engines (zero delays) and wrk (one connection) on core 1; the counts
over a window of requests, less the same process's counts per second while idle, divided by the
requests. `bench/floor_proxy.py` (the least a Python PD proxy can run, vLLM flow only) is measured
the same way as a reference row. A count is not a time (the router runs cold between requests
at one connection, on caches the VM shares), so compare counts across checkouts, and time
against the Rust routers with bench.router_overhead.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.router_overhead import (PD_ROUTER_CONFIG, WRK_LUA, ReferenceProxyProcess, Target,
                                   measure_wrk)
from pd_plugins.testing.processes import ManagedProcess
from pd_plugins.testing.router_harness import MockEngineProcess, RouterProcess

CASES = {  # name: (engine, streaming)
    "vllm_pull": ("vllm", False),
    "vllm_pull_stream": ("vllm", True),
    "sglang": ("sglang", False),
}
CACHES = ("--cache-sim=yes", "--I1=32768,8,64", "--D1=32768,8,64", "--LL=1048576,16,64")
WARM_S, WINDOW_S = 4, 6
RESULTS = common.RESULTS / "router_instructions"
FLOOR = "Python floor proxy (reference)"


def under_callgrind(cmd: list[str], out: str) -> list[str]:
    at = cmd.index(sys.executable)
    return [*cmd[:at], "valgrind", "--tool=callgrind", *CACHES, f"--callgrind-out-file={out}.%p",
            *cmd[at:]]


class CallgrindRouter(RouterProcess):
    """pd-router under valgrind --tool=callgrind, its code from `tree` (a checkout's root)."""

    tree: str = ""
    out: str = ""

    def command(self) -> list[str]:
        return under_callgrind(super().command(), self.out)

    def environment(self) -> dict[str, str]:
        # PYTHONSAFEPATH: `python -m` would put the current directory (this checkout) on sys.path
        # ahead of PYTHONPATH, and every tree would run this checkout's code
        return {**super().environment(), "PYTHONPATH": self.tree, "PYTHONSAFEPATH": "1"}


class CallgrindFloor(ReferenceProxyProcess):
    """bench/floor_proxy.py under valgrind --tool=callgrind (this checkout's)."""

    out: str = ""

    def command(self) -> list[str]:
        return under_callgrind(super().command(), self.out)


def dump(proc: ManagedProcess, out: str) -> dict[str, int]:
    """The counts since the last zeroing (callgrind_control -d), as {event: count}; zeroed again."""
    before = set(Path(out).parent.glob(Path(out).name + ".*"))
    subprocess.run(["callgrind_control", "-d", str(proc.proc.pid)], capture_output=True, check=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        new = set(Path(out).parent.glob(Path(out).name + ".*")) - before
        if new:
            text = Path(new.pop()).read_text()
            events = re.search(r"^events:\s+(.*)$", text, re.M)[1].split()
            totals = re.search(r"^(?:summary|totals):\s+([\d ]+)$", text, re.M)[1].split()
            return dict(zip(events, map(int, totals)))
        time.sleep(0.2)
    raise TimeoutError("callgrind wrote no dump")


def measure(tree: str, case: str, workdir: Path) -> dict:
    engine, stream = CASES[case]
    mocks = [MockEngineProcess(f"{case}-{role}", role=role, engine=engine, cpu="1",
                               args=("--ttft-ms", "0", "--tpot-ms", "0"), log_dir=workdir)
             for role in ("prefill", "decode")]
    flags = ("--engine", engine, *(("--transfer", "pull") if engine == "vllm" else ()),
             "--policy", "round_robin", "--log-level", "warning")
    out = str(workdir / f"{case}.callgrind")
    if tree == FLOOR:
        router = CallgrindFloor("floor", module="bench.floor_proxy", prefill=mocks[0],
                                decode=mocks[1], cpu="0", log_dir=workdir)
        router.out = out
    else:
        router = CallgrindRouter(f"{case}-router", prefill=[mocks[0].worker_arg()],
                                 decode=[mocks[1].worker_arg()], args=flags,
                                 config=PD_ROUTER_CONFIG, cpu="0", log_dir=workdir)
        router.tree, router.out = tree, out
    lua = workdir / "post.lua"
    lua.write_text(WRK_LUA)
    processes = [*mocks, router]
    try:
        for p in processes:
            p.start()
        for p in processes:
            p.wait_healthy(600)
        target = Target(case, case, router.url, router, stream=stream)
        measure_wrk(target, 1, 0, WARM_S, lua)
        subprocess.run(["callgrind_control", "-z", str(router.proc.pid)], capture_output=True,
                       check=True)
        began = time.monotonic()
        run = measure_wrk(target, 1, 0, WINDOW_S, lua)
        busy, busy_s = dump(router, out), time.monotonic() - began
        began = time.monotonic()
        time.sleep(WINDOW_S / 2)
        idle, idle_s = dump(router, out), time.monotonic() - began
    finally:
        for p in reversed(processes):
            p.stop()
    n = run["n"]
    if not n or run["errors"]:
        raise RuntimeError(f"{case}: {n} requests, errors {run['error_samples']}")
    per = {ev: (busy[ev] - idle.get(ev, 0) / idle_s * busy_s) / n for ev in busy}
    l1 = per["I1mr"] + per["D1mr"] + per["D1mw"]
    ll = per["ILmr"] + per["DLmr"] + per["DLmw"]
    return {"requests": n, "Ir": per["Ir"], "I1 misses": per["I1mr"],
            "D1 misses": per["D1mr"] + per["D1mw"], "LL misses": ll,
            "est. cycles": per["Ir"] + 10 * l1 + 100 * ll}


COLUMNS = ("Ir", "I1 misses", "D1 misses", "LL misses", "est. cycles")
SECTION = "router-instructions"  # its markers in docs/benchmarks.md (common.write_section)


def table(results: dict[str, dict[str, dict]]) -> list[str]:
    """Rows per case and checkout; each count also as a ratio to this checkout's (the first)."""
    names = list(results)
    lines = ["| case | router | " + " | ".join(f"{c} per request" for c in COLUMNS) + " |",
             "|---|---|" + "---:|" * len(COLUMNS)]
    for case in CASES:
        first = results[names[0]].get(case)
        for name in names:
            row = results[name].get(case)
            if row is None:
                continue
            cells = [f"{row[c]:,.0f}" + (f" ({row[c] / first[c]:.2f}x)"
                                          if name != names[0] and first and first[c] else "")
                     for c in COLUMNS]
            lines.append(f"| {case} | {name} | " + " | ".join(cells) + " |")
    return lines


def named(tree: str) -> str:
    """Another tree as the docs name it: its commit where it is a git checkout, else its path."""
    rev = common.git_rev(tree)
    return tree if rev == "?" else f"git {rev}"


def markdown(results: dict[str, dict[str, dict]], trees: dict[str, str], took_s: float) -> str:
    now = dt.datetime.now(dt.timezone.utc)
    valgrind = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout
    return "\n".join([
        f"<!-- {SECTION}:start -->",
        "## Router instructions per request (callgrind)",
        "",
        "What pd-router's process executes per PD request, counted by valgrind's callgrind: "
        "instructions (Ir) and the misses of a simulated 32 KiB L1 instruction and data cache "
        "and a 1 MiB last level, and callgrind's cycle estimate from them (Ir + 10 x L1 misses + "
        "100 x LL misses). These counts do not depend on the machine's load (the same tree "
        "measured twice agrees within about 2%), so they tell apart changes of a few percent "
        "that CPU time on this VM cannot (\"Router overhead\"); they are not times. Each case: "
        "one connection (wrk), every request disaggregated (`--policy round_robin`), zero-delay "
        "mock engines, the router alone on core 0 under valgrind; the counts over "
        f"{WINDOW_S} s of requests less the idle process's per second. The ratios in brackets are "
        f"to this checkout's row.",
        "",
        f"Rerun: `.venv/bin/python -m bench.router_instructions` (an A/B: `--tree NAME=DIR` with "
        f"another checkout, e.g. a `git worktree`). This run: {now:%Y-%m-%d %H:%M} UTC, "
        f"{took_s / 60:.1f} min; this checkout: git {common.git_rev()}"
        + "".join(f"; {name}: {named(tree)}" for name, tree in trees.items()
                  if name not in ("this checkout", FLOOR))
        + f"; Python {platform.python_version()} (from {sys.base_prefix}), {valgrind.strip()}.",
        "",
        *table(results),
        f"<!-- {SECTION}:end -->",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="another checkout whose router is measured beside this one's (an A/B)")
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    ap.add_argument("--no-docs", action="store_true", help="print the table, leave docs/ alone")
    args = ap.parse_args()
    if not shutil.which("valgrind") or not shutil.which("wrk"):
        sys.exit("router_instructions needs valgrind and wrk (apt-get install valgrind wrk)")
    os.sched_setaffinity(0, {1})
    trees = {"this checkout": str(common.ROOT)}
    for spec in args.tree:
        name, _, path = spec.rpartition("=")
        trees[name or path] = str(Path(path).resolve())
    trees[FLOOR] = FLOOR
    results: dict[str, dict[str, dict]] = {name: {} for name in trees}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pd-callgrind-") as tmp:
        for case in args.cases:
            for name, tree in trees.items():
                if tree == FLOOR and CASES[case][0] != "vllm":
                    continue  # the floor proxy runs vLLM's flow only
                row = results[name][case] = measure(tree, case, Path(tmp))
                print(f"{case:17s} {name:20s} " + ", ".join(f"{c} {row[c]:,.0f}" for c in COLUMNS),
                      flush=True)
    text = markdown(results, trees, time.monotonic() - began)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "results.json").write_text(json.dumps(results, indent=1))
    if not args.no_docs:
        common.write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
