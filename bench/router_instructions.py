#!/usr/bin/env python
"""pd-router's instructions and simulated cache misses per PD request, under callgrind.

    .venv/bin/python -m bench.router_instructions      # this checkout and the floor proxy, ~4 min
    .venv/bin/python -m bench.router_instructions --tree before=/tmp/old
                            # an A/B: another checkout's router beside this one's (a git worktree)
    .venv/bin/python -m bench.router_instructions --bytecodes
                            # where the Python runs: bytecodes per request by file and function

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

`--bytecodes` runs the same cases under bench/bytecode_trace.py instead: the Python bytecodes the
router's event loop executes per request, by file and by function, counted exactly (callgrind sees
the interpreter's C functions only: Python 3.11 has no perf map of Python frames).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.router_overhead import (MAX_TOKENS, PD_ROUTER_CONFIG, PROMPT, WRK_LUA, CheckoutRouter,
                                   ReferenceProxyProcess, Target, measure_wrk)
from pd_plugins.routers import native
from pd_plugins.testing.processes import ManagedProcess
from pd_plugins.testing.router_harness import MockEngineProcess

CASES = {  # name: (engine, streaming, the prompt's characters: None for the overhead bench's)
    "vllm_pull": ("vllm", False, None),
    "vllm_pull_stream": ("vllm", True, None),
    "sglang": ("sglang", False, None),
    # a prompt of about 8k tokens (Mooncake's are 7.6k on average): what grows with its bytes
    "vllm_pull_32k": ("vllm", False, 32_000),
}
CACHES = ("--cache-sim=yes", "--I1=32768,8,64", "--D1=32768,8,64", "--LL=1048576,16,64")
WARM_S, WINDOW_S = 4, 6
RESULTS = common.RESULTS / "router_instructions"
FLOOR = "Python floor proxy (reference)"
INTERPRETED = "this checkout, interpreted"  # its router with PD_ROUTER_NATIVE=0 (native.py)


def under_callgrind(cmd: list[str], out: str) -> list[str]:
    at = cmd.index(sys.executable)
    return [*cmd[:at], "valgrind", "--tool=callgrind", *CACHES, f"--callgrind-out-file={out}.%p",
            *cmd[at:]]


def under_bytecode_trace(cmd: list[str]) -> list[str]:
    """`python -m MODULE ARGS` as `python bench/bytecode_trace.py MODULE ARGS` (this checkout's
    tracer; the module comes from PYTHONPATH)."""
    at = cmd.index(sys.executable)
    assert cmd[at + 1] == "-m", cmd
    return [*cmd[:at + 1], str(common.ROOT / "bench" / "bytecode_trace.py"), *cmd[at + 2:]]


def counted(cmd: list[str], lens: str, out: str) -> list[str]:
    """A router's command under the lens that counts it ("callgrind" or "bytecodes")."""
    return under_callgrind(cmd, out) if lens == "callgrind" else under_bytecode_trace(cmd)


class CountedRouter(CheckoutRouter):
    """pd-router under callgrind (`lens` "callgrind") or the bytecode tracer ("bytecodes"), its
    code from `tree` (a checkout's root)."""

    out: str = ""
    lens: str = "callgrind"

    def command(self) -> list[str]:
        return counted(super().command(), self.lens, self.out)

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "PD_BYTECODES_OUT": self.out}


class CountedFloor(ReferenceProxyProcess):
    """bench/floor_proxy.py under callgrind or the bytecode tracer (this checkout's)."""

    out: str = ""
    lens: str = "callgrind"

    def command(self) -> list[str]:
        return counted(super().command(), self.lens, self.out)

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "PYTHONPATH": str(common.ROOT), "PYTHONSAFEPATH": "1",
                "PD_BYTECODES_OUT": self.out}


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


def bytecodes_written(proc: ManagedProcess, out: str) -> dict[str, list[int]]:
    """The tracer's counts since its last zeroing (SIGUSR2 writes them)."""
    Path(out).unlink(missing_ok=True)
    os.kill(proc.proc.pid, signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            return json.loads(Path(out).read_text())
        except (OSError, ValueError):  # not written yet, or half
            time.sleep(0.2)
    raise TimeoutError("the bytecode tracer wrote no counts")


def long_body(prompt_chars: int) -> bytes:
    """The overhead bench's request with its prompt repeated to `prompt_chars` characters."""
    prompt = (PROMPT * (prompt_chars // len(PROMPT) + 1))[:prompt_chars]
    return json.dumps({"model": "mock", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "stream": False}).encode()


def measure(tree: str, case: str, workdir: Path, lens: str = "callgrind") -> dict:
    """One case's counts per request: callgrind's events ("callgrind") or, per function, the
    bytecodes and calls ("bytecodes": {"FILE:LINE:NAME": [bytecodes, calls]})."""
    engine, stream, prompt_chars = CASES[case]
    mocks = [MockEngineProcess(f"{case}-{role}", role=role, engine=engine, cpu="1",
                               args=("--ttft-ms", "0", "--tpot-ms", "0", "--max-model-len", "32768"),
                               log_dir=workdir)
             for role in ("prefill", "decode")]
    flags = ("--engine", engine, *(("--transfer", "pull") if engine == "vllm" else ()),
             "--policy", "round_robin", "--log-level", "warning")
    out = str(workdir / f"{case}.{lens}")
    if tree == FLOOR:
        router = CountedFloor("floor", module="bench.floor_proxy", prefill=mocks[0],
                              decode=mocks[1], cpu="0", log_dir=workdir)
    else:
        router = CountedRouter(f"{case}-router", prefill=[mocks[0].worker_arg()],
                               decode=[mocks[1].worker_arg()], args=flags,
                               config=PD_ROUTER_CONFIG, cpu="0", log_dir=workdir)
        router.tree = str(common.ROOT) if tree == INTERPRETED else tree
        if tree == INTERPRETED:  # PD_ROUTER_NATIVE=0: the hot path's modules as Python
            router.env = {native.SWITCH: "0"}
    router.out, router.lens = out, lens
    lua = workdir / "post.lua"
    lua.write_text(WRK_LUA)
    processes = [*mocks, router]
    try:
        for p in processes:
            p.start()
        for p in processes:
            p.wait_healthy(600)
        target = Target(case, case, router.url, router, stream=stream,
                        body=long_body(prompt_chars) if prompt_chars else None)
        measure_wrk(target, 1, 0, WARM_S, lua)
        if lens == "bytecodes":
            os.kill(router.proc.pid, signal.SIGUSR1)
            time.sleep(0.5)  # (a signal's handler runs at the loop's next bytecode)
            run = measure_wrk(target, 1, 0, WINDOW_S, lua)
            counts = bytecodes_written(router, out)
        else:
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
    if run["routes"].get("local"):  # (a failing prefill leg falls back to the decode alone)
        raise RuntimeError(f"{case}: {run['routes']['local']} of {n} requests were not "
                           f"disaggregated (served local): the router log says why")
    if lens == "bytecodes":  # (the idle process runs a few health and timer callbacks: kept)
        return {name: [ops / n, called / n] for name, (ops, called) in counts.items()}
    per = {ev: (busy[ev] - idle.get(ev, 0) / idle_s * busy_s) / n for ev in busy}
    l1 = per["I1mr"] + per["D1mr"] + per["D1mw"]
    ll = per["ILmr"] + per["DLmr"] + per["DLmw"]
    return {"requests": n, "Ir": per["Ir"], "I1 misses": per["I1mr"],
            "D1 misses": per["D1mr"] + per["D1mw"], "LL misses": ll,
            "est. cycles": per["Ir"] + 10 * l1 + 100 * ll}


COLUMNS = ("Ir", "I1 misses", "D1 misses", "LL misses", "est. cycles")
SECTION = "router-instructions"  # its markers in docs/benchmarks.md (common.write_section)
BYTECODE_SECTION = "router-bytecodes"  # --bytecodes' section


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


def checkouts(trees: dict[str, str]) -> str:
    """Which code ran: this checkout's commit, the other trees', and the interpreter."""
    others = "".join(f"; {name}: {named(tree)}" for name, tree in trees.items()
                     if name not in ("this checkout", FLOOR, INTERPRETED))
    return (f"this checkout: git {common.git_rev()}{others}; Python {platform.python_version()} "
            f"(from {sys.base_prefix})")


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
        f"{WINDOW_S} s of requests less the idle process's per second. The request is the "
        "overhead bench's (a ~60-token prompt, 8 tokens out), except in `vllm_pull_32k`: its "
        "prompt repeated to 32,000 characters (about 8k tokens, Mooncake's mean), for what grows "
        "with a request's bytes. This checkout's router runs its hot path compiled where a build "
        "of its sources exists (`make bootstrap`; docs/router.md, \"Native hot path\"); the row "
        "\"this checkout, interpreted\" is the same code with `PD_ROUTER_NATIVE=0`. The ratios in "
        "brackets are to this checkout's row.",
        "",
        f"Rerun: `.venv/bin/python -m bench.router_instructions` (an A/B: `--tree NAME=DIR` with "
        f"another checkout, e.g. a `git worktree`). This run: {now:%Y-%m-%d %H:%M} UTC, "
        f"{took_s / 60:.1f} min; {checkouts(trees)}, {valgrind.strip()}.",
        "",
        *table(results),
        f"<!-- {SECTION}:end -->",
    ])


def where(name: str) -> str:
    """A counted function's file, short: a path inside a checkout or a package, else as it is."""
    path = name.split(":", 1)[0]
    if path == "<string>":  # code compiled at run time: here, dataclasses' generated __init__
        return "<string> (generated code)"
    for marker in ("/site-packages/", "/pd_plugins/", "/bench/"):
        if marker in path:
            return (marker.strip("/") + "/" if marker != "/site-packages/" else "") \
                + path.split(marker, 1)[1]
    return path


def bytecode_tables(results: dict[str, dict[str, dict]], top_files: int = 8,
                    top_functions: int = 15) -> list[str]:
    """Per case: bytecodes per request by file for each tree, then this checkout's functions."""
    names = list(results)
    lines = []
    for case in CASES:
        rows = {name: results[name][case] for name in names if case in results[name]}
        if not rows:
            continue
        totals = {name: sum(ops for ops, _ in row.values()) for name, row in rows.items()}
        lines += ["", f"**{case}**: bytecodes per request " + ", ".join(
            f"{name} {total:,.0f}" for name, total in totals.items()) + ".", "",
            "| file | " + " | ".join(rows) + " |", "|---|" + "---:|" * len(rows)]
        by_file = {name: {} for name in rows}
        for name, row in rows.items():
            for function, (ops, _) in row.items():
                by_file[name][where(function)] = by_file[name].get(where(function), 0) + ops
        first = by_file[names[0]] if names[0] in by_file else next(iter(by_file.values()))
        for path in sorted(first, key=first.get, reverse=True)[:top_files]:
            lines.append(f"| {path} | " + " | ".join(
                f"{files.get(path, 0):,.0f} ({files.get(path, 0) / totals[name]:.0%})"
                for name, files in by_file.items()) + " |")
        own = rows.get(names[0], {})
        lines += ["", f"{names[0]}'s functions with the most bytecodes per request ({case}):", "",
                  "| function | bytecodes | calls | per call |", "|---|---:|---:|---:|"]
        for function, (ops, called) in sorted(own.items(), key=lambda kv: -kv[1][0])[:top_functions]:
            _, line, qualname = function.rsplit(":", 2)
            lines.append(f"| `{qualname}` ({where(function)}:{line}) | {ops:,.0f} | {called:.2f} "
                         f"| {ops / called if called else 0:,.0f} |")
    return lines


def bytecode_markdown(results: dict[str, dict[str, dict]], trees: dict[str, str],
                      took_s: float) -> str:
    now = dt.datetime.now(dt.timezone.utc)
    return "\n".join([
        f"<!-- {BYTECODE_SECTION}:start -->",
        "## Router bytecodes per request",
        "",
        "The Python bytecodes pd-router's event loop executes per PD request, by file and by "
        "function, counted exactly by a tracer (`bench/bytecode_trace.py`: `sys.settrace` with "
        "opcode events). Same harness as the callgrind counts above (one connection, every "
        "request disaggregated, zero-delay mocks). The count of what ran is exact; what runs "
        "varies a little with timing (how the bytes arrive in reads, timers): two runs of the "
        "same tree agree within about 2%. What C code does for a call (httptools, msgspec, "
        "uvloop, the kernel) is not in them, and bytecodes differ in cost (a call costs more "
        "than a store), so they say where the Python runs, not what it costs (the callgrind "
        "counts above; CPU time in \"Router overhead\"). Calls count a coroutine's resumptions. "
        "The tracer sees only interpreted code: in this checkout's row, what still runs as Python "
        "beside the compiled hot path (docs/router.md, \"Native hot path\"); the row \"this "
        "checkout, interpreted\" is all of it.",
        "",
        f"Rerun: `.venv/bin/python -m bench.router_instructions --bytecodes` (about 2 min; "
        f"`--tree NAME=DIR` as above). This run: {now:%Y-%m-%d %H:%M} UTC, {took_s / 60:.1f} min; "
        f"{checkouts(trees)}.",
        *bytecode_tables(results),
        f"<!-- {BYTECODE_SECTION}:end -->",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="another checkout whose router is measured beside this one's (an A/B)")
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    ap.add_argument("--bytecodes", action="store_true",
                    help="count Python bytecodes per function (bench/bytecode_trace.py) instead "
                         "of instructions under callgrind")
    ap.add_argument("--no-docs", action="store_true", help="print the table, leave docs/ alone")
    args = ap.parse_args()
    lens = "bytecodes" if args.bytecodes else "callgrind"
    needs = ["wrk"] + (["valgrind"] if lens == "callgrind" else [])
    if not all(map(shutil.which, needs)):
        sys.exit(f"router_instructions {'--bytecodes ' if lens == 'bytecodes' else ''}needs "
                 f"{' and '.join(needs)} (apt-get install {' '.join(needs)})")
    os.sched_setaffinity(0, {1})
    trees = {"this checkout": str(common.ROOT), INTERPRETED: INTERPRETED}
    for spec in args.tree:
        name, _, path = spec.rpartition("=")
        trees[name or path] = str(Path(path).resolve())
    trees[FLOOR] = FLOOR
    results: dict[str, dict[str, dict]] = {name: {} for name in trees}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pd-router-counts-") as tmp:
        for case in args.cases:
            for name, tree in trees.items():
                if tree == FLOOR and CASES[case][0] != "vllm":
                    continue  # the floor proxy runs vLLM's flow only
                row = results[name][case] = measure(tree, case, Path(tmp), lens)
                if lens == "bytecodes":
                    print(f"{case:17s} {name:20s} bytecodes "
                          f"{sum(ops for ops, _ in row.values()):,.0f}", flush=True)
                else:
                    print(f"{case:17s} {name:20s} "
                          + ", ".join(f"{c} {row[c]:,.0f}" for c in COLUMNS), flush=True)
    took = time.monotonic() - began
    text = (bytecode_markdown(results, trees, took) if lens == "bytecodes"
            else markdown(results, trees, took))
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{lens}.json").write_text(json.dumps(results, indent=1))
    if not args.no_docs:
        common.write_section(BYTECODE_SECTION if lens == "bytecodes" else SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
