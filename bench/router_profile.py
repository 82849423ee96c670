#!/usr/bin/env python
"""Where pd-router's CPU goes on the PD hot path: py-spy flame graphs under load.

    .venv/bin/python -m bench.router_profile            # three profiles, about 3 minutes

For each case (vLLM pull flow non-streaming and streaming, SGLang flow non-streaming; every
request disaggregated, `--policy round_robin`) a pd-router runs alone on core 0 and mock prefill
and decode engines (zero delays) and wrk (Debian's `wrk`: `apt-get install wrk`) on core 1, at 16
connections; py-spy samples the router for 15 s per output at 250 Hz, native frames included
(`--native`: the compiled hot path's functions are native frames, named by mypyc after their
modules, `CPyDef_<module>___<function>`, and counted with their modules; docs/router.md, "Native
hot path"): the samples where the router waits for work (its event loop in epoll, a pool thread
on a futex) are told apart from those where it runs, and the shares are of the latter (py-spy
samples wall-clock time: without this, idle time counted as "event loop"). Writes
docs/img/router_flame_<case>.svg, the largest shares (self time by function, and the parts of
the path) to bench/results/router_profile.json, and the table of the "Router hot path profile"
section of docs/benchmarks.md (between its markers; the reading below them is written by hand).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.router_overhead import PD_ROUTER_CONFIG, PROMPT
from pd_plugins.routers import native
from pd_plugins.testing.router_harness import MockEngineProcess, RouterProcess

CASES = {  # name: (engine, streaming)
    "vllm_pull": ("vllm", False),
    "vllm_pull_stream": ("vllm", True),
    "sglang": ("sglang", False),
}
SECONDS, RATE, CONNECTIONS = 30, 250, 16
WRK_SCRIPT = 'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n' \
             'wrk.body = os.getenv("PD_BENCH_BODY")\n'
# the parts of the path, by the source file of the frames they are under (first match wins)
PARTS = (("front server (HTTP in/out)", ("http_server.py",)),
         ("legs' HTTP client", ("http_client.py", "upstream.py", "deadline.py")),
         ("request checks", ("request.py",)),
         ("policy and accounting", ("policy/", "accounting.py", "workers.py")),
         ("proxy and flow", ("proxy.py", "exchange.py", "failover.py", "flows/")))


EVENT_LOOP = "event loop (uvloop C: timers, task switching)"
SOCKET_IO = "socket reads and writes (system calls)"
# a sample whose innermost (native) frame is one of these is the router waiting, not working
IDLE_LEAVES = ("epoll_wait", "epoll_pwait", "epoll_pwait2", "poll", "ppoll", "select",
               "pselect", "futex", "__futex_abstimed_wait_common", "pthread_cond_wait",
               "pthread_cond_timedwait", "sem_wait", "sem_timedwait", "do_futex_wait", "nanosleep",
               "clock_nanosleep")
SOCKET_LEAVES = ("write", "writev", "send", "sendto", "sendmsg", "read", "readv", "recv",
                 "recvfrom", "recvmsg")
TITLES = {"vllm_pull": "vLLM pull, non-streaming", "vllm_pull_stream": "vLLM pull, streaming",
          "sglang": "SGLang, non-streaming"}


def py_spy() -> str:
    found = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if not found:
        sys.exit("py-spy is not installed (a test dependency of the project: make bootstrap)")
    return found


def compiled_sources() -> dict[str, str]:
    """The C name prefix of each module the native build compiles (mypyc names a function of
    module a.b.c `CPyDef_c___f`, with as much of the module's name as tells it from the others
    of the build) -> its source file, as a Python frame names it. py-spy's native frames show
    the compiled functions by these names."""
    try:
        from mypyc.namegen import exported_name, make_module_translation_map
    except ImportError:  # no mypyc: no build, nothing compiled to attribute
        return {}
    prefixes = make_module_translation_map(list(native.HOT_MODULES))
    return {exported_name(prefixes[m].rstrip(".")) + "___": m.replace(".", "/") + ".py"
            for m in native.HOT_MODULES}


COMPILED = compiled_sources()


def source_of(frame: str) -> str:
    """The source a frame of py-spy's collapsed stacks runs: a Python frame's file, or a compiled
    function's module (mypyc's C wrappers `CPyDef_`, `CPyPy_` and the like before its name)."""
    name, _, where = frame.partition(" (")
    if not where.rpartition("/")[2].startswith("__native_"):  # (mypyc's C: __native_<group>.c)
        return where
    name = name.partition("_")[2] if name.startswith("CPy") else name
    return next((source for prefix, source in COMPILED.items() if name.startswith(prefix)), where)


def profile(case: str, engine: str, stream: bool, workdir: Path) -> dict:
    body = json.dumps({"model": "mock", "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                       "stream": stream})
    mocks = [MockEngineProcess(name=f"{case}-{role}", role=role, engine=engine, cpu="1",
                               args=("--ttft-ms", "0", "--tpot-ms", "0"), log_dir=workdir)
             for role in ("prefill", "decode")]
    router = None
    try:
        for m in mocks:
            m.start()
        for m in mocks:
            m.wait_healthy(60)
        router = RouterProcess(name=f"{case}-router", prefill=[mocks[0].worker_arg()],
                               decode=[mocks[1].worker_arg()], config=PD_ROUTER_CONFIG,
                               args=("--policy", "round_robin", "--engine", engine), cpu="0",
                               log_dir=workdir)
        router.start()
        router.wait_healthy(60)
        script = workdir / "post.lua"
        script.write_text(WRK_SCRIPT)
        load = subprocess.Popen(["taskset", "-c", "1", "wrk", "-t1", f"-c{CONNECTIONS}",
                                 f"-d{SECONDS + 3}s", "-s", str(script), router.url + "/v1/completions"],
                                env={**os.environ, "PD_BENCH_BODY": body}, stdout=subprocess.PIPE,
                                text=True)
        time.sleep(1.5)
        raw = workdir / f"{case}.txt"
        svg = common.IMG / f"router_flame_{case}.svg"
        for fmt, out in (("raw", raw), ("flamegraph", svg)):
            subprocess.run([py_spy(), "record", "-p", str(router.proc.pid), "-d", str(SECONDS // 2),
                            "-r", str(RATE), "-f", fmt, "-o", str(out), "--native"],
                           check=True, capture_output=True)
        wrk_out = load.communicate()[0]
        rate = next((float(line.split()[1]) for line in wrk_out.splitlines()
                     if line.startswith("Requests/sec:")), None)
        print(f"{case}: {rate} requests/s", flush=True)
        return shares(raw) | {"requests_per_s": rate,
                              "flame_graph": str(svg.relative_to(common.ROOT))}
    finally:
        if router is not None:
            router.stop()
        for m in mocks:
            m.stop()


def shares(raw: Path) -> dict:
    """Self time by function, and by part of the path (py-spy's collapsed stacks), as shares of
    the samples where the router was busy."""
    own: collections.Counter = collections.Counter()
    parts: collections.Counter = collections.Counter()
    total = busy = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        leaf = frames[-1].split(" (", 1)[0]
        if leaf in IDLE_LEAVES:
            continue
        busy += n
        own[frames[-1]] += n
        part = SOCKET_IO if leaf in SOCKET_LEAVES else EVENT_LOOP
        for frame in reversed(frames) if part == EVENT_LOOP else ():
            # the innermost of our frames names the part
            source = source_of(frame)
            match = next((name for name, files in PARTS if any(f in source for f in files)), None)
            if match:
                part = match
                break
        parts[part] += n
    unattributed = sum(n for frame, n in own.items()
                       if frame.startswith("CPyDef_") and not source_of(frame).endswith(".py"))
    if unattributed:  # (mypyc named them otherwise: they counted as "event loop")
        print(f"warning: {unattributed} samples in compiled functions of no known module",
              file=sys.stderr)
    per_busy = 100 / max(busy, 1)
    return {"samples": total, "busy_share": round(busy * 100 / max(total, 1), 1),
            "parts": {k: round(v * per_busy, 1) for k, v in parts.most_common()},
            "top_self": [[f, round(n * per_busy, 1)] for f, n in own.most_common(12)]}


def main() -> None:
    if not shutil.which("wrk"):
        sys.exit("wrk is not installed: apt-get install wrk")
    results = {"machine": common.machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "connections": CONNECTIONS, "seconds": SECONDS, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="pd-router-profile-") as tmp:
        for case, (engine, stream) in CASES.items():
            results["cases"][case] = profile(case, engine, stream, Path(tmp))
    out = common.RESULTS / "router_profile.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    for case, r in results["cases"].items():
        print(case, json.dumps(r["parts"]))
    common.write_section("router-profile", markdown(results))
    print(f"wrote {out}, docs/img/router_flame_*.svg and docs/benchmarks.md")


def markdown(results: dict) -> str:
    """The section's table: each case's rate under the profiler and its share per part."""
    columns = [SOCKET_IO, EVENT_LOOP, *(name for name, _ in PARTS)]
    lines = ["<!-- router-profile:start -->", "## Router hot path profile", "",
             "Where pd-router's CPU goes on the PD hot path (`.venv/bin/python -m "
             "bench.router_profile`, about 3 minutes): a router alone on core 0 with `--policy "
             "round_robin` (every request runs both legs), mock engines and wrk on core 1 at "
             f"{results['connections']} connections, py-spy sampling the router for "
             f"{results['seconds'] // 2} s per output at {RATE} Hz. Run {results['date']} on "
             f"{results['machine']}; numbers also in `bench/results/router_profile.json` (not "
             "committed). Shares are of the samples where the router was busy (column \"busy\": "
             "of all its samples; the rest it waited for work), by the innermost of our frames "
             "(outside all of them: the event loop), the socket system calls apart.", "",
             "| case | req/s | busy | " + " | ".join(columns) + " |",
             "|---|---:|---:|" + "---:|" * len(columns)]
    for case, r in results["cases"].items():
        rate = r.get("requests_per_s")
        cells = [f"{r['parts'].get(c, 0.0):.0f}%" for c in columns]
        lines.append((f"| {TITLES[case]} | {rate:.0f} | " if rate else f"| {TITLES[case]} | - | ")
                     + f"{r.get('busy_share', 100.0):.0f}% | ")
        lines[-1] += " | ".join(cells) + " |"
    links = ", ".join(f"[{TITLES[case]}]({Path(r['flame_graph']).relative_to('docs')})"
                      for case, r in results["cases"].items())
    lines += ["", f"Flame graphs: {links}.", "", "<!-- router-profile:end -->"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
