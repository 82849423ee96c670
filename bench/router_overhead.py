#!/usr/bin/env python
"""Router overhead: pd-router against vllm-router and sglang-router on mock engines.

    .venv/bin/python -m bench.router_overhead            # full run, about 17 minutes
    .venv/bin/python -m bench.router_overhead --quick    # smoke run, about 2.5 minutes
    .venv/bin/python -m bench.router_overhead --quick --no-docs   # results under bench/results only
    .venv/bin/python -m bench.router_overhead --targets pd-vllm vllm-router --streaming off \
        --repeats 5 --tree before=/tmp/before   # an A/B in CPU time: another checkout's pd-router
                                                # (e.g. a git worktree) interleaved with this one's

Mock prefill and decode engines (zero delays; `--engines`: bench/fast_engine.py, the default, so
cheap that the routers' core saturates first, or pd-mock-engine, which saturates its own core
first) and the load generator share core 1; each router runs alone on core 0. For every target
and concurrency the closed-loop load generator (`--loadgen`: wrk where installed, the default, or
an aiohttp loop in this process, which saturates core 1 before the routers) measures requests/s
and latency over a fixed window, and the router's CPU time (utime + stime from /proc/PID/stat)
over the same window gives CPU per request. Targets: the decode engine directly
(no router: the latency baseline), pd-router (vLLM pull flow), vllm-router, pd-router --engine
sglang, sglang-router, bench/naive_proxy.py (the least an aiohttp PD proxy can do) and
bench/floor_proxy.py (the least any Python PD proxy can do: protocol callbacks, no task per
request); named in --targets, also bench/lean_router.py (pd-router's own per-request work on the
floor's I/O). Every request is disaggregated (round_robin everywhere), except
in one more row: pd-router's default policy, which prefills a short prompt on the decode itself.
Each target runs non-streaming and streaming (`--streaming`; the naive proxy and the lean router
non-streaming only; `--targets` for some of them),
and the end of the run checks issue 30's goals against the Rust routers of the same run.

The peer routers are installed on demand into bench/.venv-peers (matplotlib too, for the plots),
so the project's .venv stays as its lock file says. Results: the "Router overhead" section of
docs/benchmarks.md (between markers, so other sections survive), docs/img/router_*.png, and the
raw numbers and every process log under bench/results/router_overhead/<timestamp>/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import requests

from bench import common
from bench.common import DOC, IMG, PEERS_PY, PEERS_VENV, PLOT_REQ, ROOT
from pd_plugins.perf.report import percentile
from pd_plugins.routers import native
from pd_plugins.testing.processes import ManagedProcess, free_port
from pd_plugins.testing.router_harness import MockEngineProcess, RouterProcess, pinned

PEER_PINS = {"vllm-router": "vllm-router==0.1.17", "sglang-router": "sglang-router==0.3.2"}
RESULTS_DIR = common.RESULTS / "router_overhead"
SECTION = "router-overhead"  # its markers in docs/benchmarks.md (common.write_section)

ROUTER_CPU, LOAD_CPU = "0", "1"
ENGINE_KINDS = ("fast", "mock")  # --engines: bench/fast_engine.py or pd-mock-engine
ENGINE_NAMES = {"fast": "`bench/fast_engine.py`", "mock": "`pd-mock-engine`"}
CONCURRENCY = (1, 16, 64)
PROMPT = ("In a disaggregated serving system the router first sends the prompt to a prefill "
          "worker, which computes the KV cache and hands it to a decode worker that streams "
          "the answer back to the client; this sentence only has to be long enough.")
MAX_TOKENS = 8  # the answer's length (--max-tokens); the mocks send it at once (--tpot-ms 0)


def request_bodies(max_tokens: int) -> dict[bool, bytes]:
    return {stream: json.dumps({"model": "mock", "prompt": PROMPT, "max_tokens": max_tokens,
                                "temperature": 0, "stream": stream}).encode()
            for stream in (False, True)}


BODIES = request_bodies(MAX_TOKENS)  # updated in place by --max-tokens
SSE_END = b"data: [DONE]"
ROUTE_RE = re.compile(r"route=(\w+)")  # pd-router's x-pd-route: route=disaggregated|local
HEADERS = {"Content-Type": "application/json"}
PD_ROUTER_CONFIG = {"health": {"interval_s": 3600, "canary": False, "metrics_interval_s": 3600}}
CLK_TCK = os.sysconf("SC_CLK_TCK")
STREAM_SUFFIX = ":stream"
STREAMING = {"both": (False, True), "off": (False,), "only": (True,)}
NON_STREAMING_ONLY = ("naive", "lean")  # reference rows that do not stream
# Issue 30's goals, checked for these pd-router rows (both flows, every request disaggregated).
CHECKED = (("pd-vllm", "pd-router (vLLM pull)"), ("pd-sglang", "pd-router --engine sglang"))
CPU_GOAL = 0.8  # CPU per request at most this times vllm-router's
LOADGENS = ("wrk", "aiohttp")
# wrk POSTs the body from the environment (one script for both modes).
WRK_LUA = ('wrk.method = "POST"\n'
           'wrk.headers["Content-Type"] = "application/json"\n'
           'wrk.body = os.getenv("WRK_BODY")\n')
WRK_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
WRK_TIME = r"([\d.]+)(us|ms|s|m|h)\b"
# pd-router's request counter by decision: the served-local share when wrk cannot see x-pd-route.
REQUESTS_SERIES_RE = re.compile(r"^pd_router_requests_total\{([^}]*)\}\s+(\S+)", re.M)
LABEL_RE = re.compile(r'(\w+)="([^"]*)"')


# -- processes ------------------------------------------------------------------------------
@dataclass
class PeerRouterProcess(ManagedProcess):
    """vllm-router or sglang-router from bench/.venv-peers, in PD mode, round robin."""

    name: str
    kind: str = "vllm"                 # vllm | sglang
    prefill: MockEngineProcess | None = None
    decode: MockEngineProcess | None = None
    cpu: str | None = None
    prometheus_port: int = field(default_factory=free_port)

    def command(self) -> list[str]:
        assert self.prefill is not None and self.decode is not None
        if self.kind == "vllm":
            cmd = [str(PEERS_VENV / "bin" / "vllm-router"), "--vllm-pd-disaggregation",
                   "--prefill", self.prefill.url]
        else:
            cmd = [str(PEERS_PY), "-m", "sglang_router.launch_router", "--pd-disaggregation",
                   "--prefill", self.prefill.url, str(self.prefill.side_port)]
        cmd += ["--decode", self.decode.url, "--policy", "round_robin",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
                "--log-level", "error", "--worker-startup-check-interval", "1",
                "--health-check-interval-secs", "3600", "--disable-retries",
                "--disable-circuit-breaker"]
        return pinned(cmd, self.cpu)

    def wait_healthy(self, timeout: float = 240.0) -> PeerRouterProcess:
        # vllm-router listens only once its workers are healthy; sglang-router answers /health
        # at once, and /readiness says when its workers are.
        path = "/health" if self.kind == "vllm" else "/readiness"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
            try:
                resp = requests.get(self.url + path, timeout=2)
                if resp.status_code == 200 and (self.kind == "vllm" or "ready" in resp.text
                                                and "not_ready" not in resp.text):
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")


@dataclass
class FastEngineProcess(ManagedProcess):
    """bench/fast_engine.py: the four engines (`ends`: vLLM prefill and decode, SGLang prefill and
    decode) in one process. Each end is a MockEngineProcess only as an address (its ports, its
    --prefill/--decode value for the routers): it is never started itself."""

    name: str
    ends: tuple[MockEngineProcess, ...] = ()
    cpu: str | None = None

    def __post_init__(self) -> None:
        self.port = self.ends[-1].port  # (its /health answers there once all four listen)

    def command(self) -> list[str]:
        ports = {(end.engine, end.role): str(end.port) for end in self.ends}
        cmd = [sys.executable, "-m", "bench.fast_engine"]
        for engine in ("vllm", "sglang"):
            cmd += [f"--{engine}", ports[engine, "prefill"], ports[engine, "decode"]]
        return pinned(cmd, self.cpu)


class CheckoutRouter(RouterProcess):
    """pd-router from another checkout (`tree`: its root), run beside this one's: an A/B."""

    tree: str = ""

    def expects_native(self) -> bool:  # (built for this checkout's sources, not another's)
        return Path(self.tree).resolve() == ROOT.resolve() and super().expects_native()

    def environment(self) -> dict[str, str]:
        # PYTHONSAFEPATH: `python -m` would put the current directory (this checkout) on sys.path
        # ahead of PYTHONPATH, and every tree would run this checkout's code
        return {**super().environment(), "PYTHONPATH": self.tree, "PYTHONSAFEPATH": "1"}


def hot_path(router: RouterProcess) -> str:
    """What the router runs: its pd_router_native_hot_path gauge (routers/native.py)."""
    try:
        text = requests.get(router.url + "/metrics", timeout=10).text
    except requests.RequestException:
        return "?"
    found = re.search(r"^pd_router_native_hot_path (\S+)", text, re.M)
    return "?" if found is None else "native" if float(found.group(1)) else "interpreted"


class LeanRouterProcess(RouterProcess):
    """bench/lean_router.py with pd-router's flags: its per-request work on the floor's I/O."""

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("pd_plugins.routers")] = "bench.lean_router"
        return cmd


def like(router: RouterProcess, kind: type[RouterProcess], name: str) -> RouterProcess:
    """Another router process (`kind`: another checkout's, the lean router) with `router`'s
    workers, flags, config, core and log directory."""
    return kind(name, prefill=router.prefill, decode=router.decode, args=router.args,
                config=router.config, cpu=router.cpu, log_dir=router.log_dir)


@dataclass
class ReferenceProxyProcess(ManagedProcess):
    """A reference proxy of bench/ (`module PREFILL_URL DECODE_URL PORT`): bench/naive_proxy.py,
    aiohttp's own cost, or bench/floor_proxy.py, the least Python can cost per PD request."""

    name: str
    module: str = "bench.naive_proxy"
    prefill: MockEngineProcess | None = None
    decode: MockEngineProcess | None = None
    cpu: str | None = None

    def command(self) -> list[str]:
        assert self.prefill is not None and self.decode is not None
        # Same cwd and environment as this process, so `bench` imports here as it did for us.
        return pinned([sys.executable, "-m", self.module, self.prefill.url,
                       self.decode.url, str(self.port)], self.cpu)


def core_busy_seconds(cpu: str) -> float:
    """Busy time of one core (all processes), from /proc/stat: user+nice+system+irq+softirq+steal."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(f"cpu{cpu} "):
                v = [int(x) for x in line.split()[1:]]
                return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / CLK_TCK
    return 0.0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads, live or gone), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # fields[0] is field 3 (state)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# -- peers venv -----------------------------------------------------------------------------
def installed_versions(dists: list[str]) -> dict[str, str | None]:
    if not PEERS_PY.exists():
        return {d: None for d in dists}
    code = ("import importlib.metadata as m, json, sys\n"
            "out = {}\n"
            "for d in sys.argv[1:]:\n"
            "    try: out[d] = m.version(d)\n"
            "    except m.PackageNotFoundError: out[d] = None\n"
            "print(json.dumps(out))")
    res = subprocess.run([str(PEERS_PY), "-c", code, *dists], capture_output=True, text=True)
    return json.loads(res.stdout) if res.returncode == 0 else {d: None for d in dists}


def ensure_peers_venv() -> tuple[dict[str, str | None], bool]:
    """Install the pinned peer routers and matplotlib into bench/.venv-peers where missing.
    Returns the peer versions (None: unavailable) and whether plotting is possible."""
    wanted = {**PEER_PINS, "matplotlib": PLOT_REQ}
    have = installed_versions(list(wanted))
    ok = {d: v is not None and (d == "matplotlib" or wanted[d].endswith("==" + v))
          for d, v in have.items()}
    if all(ok.values()):
        return {d: have[d] for d in PEER_PINS}, True
    if not PEERS_PY.exists():
        print(f"creating {PEERS_VENV.relative_to(ROOT)} for the peer routers and matplotlib", flush=True)
        base = getattr(sys, "_base_executable", None) or "python3"
        res = subprocess.run([base, "-m", "venv", str(PEERS_VENV)], capture_output=True, text=True)
        if res.returncode != 0:
            print(f"  cannot create the venv: {res.stderr.strip()[-500:]}\n  skipping peers and plots")
            return {d: None for d in PEER_PINS}, False
    for dist, req in wanted.items():
        if ok[dist]:
            continue
        print(f"  pip install {req} into {PEERS_VENV.relative_to(ROOT)}", flush=True)
        res = subprocess.run([str(PEERS_PY), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              req], capture_output=True, text=True)
        if res.returncode != 0:
            what = "its rows" if dist in PEER_PINS else "the plots"
            print(f"  could not install {req}; skipping {what}:\n    "
                  + "\n    ".join(res.stderr.strip().splitlines()[-5:]), flush=True)
    have = installed_versions(list(wanted))
    return {d: have[d] for d in PEER_PINS}, have.get("matplotlib") is not None


# -- load generation ------------------------------------------------------------------------
@dataclass
class Target:
    key: str                     # base key and mode: "pd-vllm", "pd-vllm:stream"
    label: str
    url: str
    proc: ManagedProcess | None  # whose CPU is counted (None: no router)
    broken: str | None = None
    stream: bool = False
    body: bytes | None = None  # what each request POSTs (default: BODIES[stream])

    @property
    def base(self) -> str:
        return base_key(self.key)


def mode_key(base: str, stream: bool) -> str:
    return base + STREAM_SUFFIX if stream else base


def base_key(key: str) -> str:
    return key.removesuffix(STREAM_SUFFIX)


@dataclass
class Window:
    start: float | None = None
    end: float | None = None


class CpuWindow:
    """The router's CPU and both cores' busy time from construction to stop()."""

    def __init__(self, target: Target) -> None:
        self.pid = target.proc.proc.pid if target.proc is not None else None
        self.cpu0 = cpu_seconds(self.pid) if self.pid else 0.0
        self.core0 = core_busy_seconds(ROUTER_CPU)
        self.load0 = core_busy_seconds(LOAD_CPU)

    def stop(self, elapsed: float) -> dict:
        cpu = (cpu_seconds(self.pid) if self.pid else 0.0) - self.cpu0
        core = core_busy_seconds(ROUTER_CPU) - self.core0
        return {"cpu_s": cpu if self.pid else None,
                # The router's core busy with anything but the router: other load on the machine.
                "foreign_pct": max(0.0, core - cpu) / elapsed * 100,
                "router_pct": cpu / elapsed * 100 if self.pid else None,
                # Core 1: load generator + mock engines; near 100 it is the bottleneck.
                "load_core_pct": (core_busy_seconds(LOAD_CPU) - self.load0) / elapsed * 100}


def result(n: int, sent: int, errors: Counter, elapsed: float, latencies_ms: tuple, cpu: dict,
           routes: dict) -> dict:
    """One measurement's record (errors: how many of each kind)."""
    return {"n": n, "sent": sent, "errors": errors.total(),
            "error_samples": sorted(f"{e} (x{k})" if k > 1 else e for e, k in errors.items() if k)[:5],
            "rps": n / elapsed if elapsed > 0 else 0.0,
            "p50_ms": latencies_ms[0] if n else None, "p99_ms": latencies_ms[1] if n else None,
            "cpu_us": cpu["cpu_s"] / n * 1e6 if (cpu["cpu_s"] is not None and n) else None,
            "window_s": elapsed, "routes": routes, **cpu}


async def measure(target: Target, concurrency: int, warm_s: float, window_s: float) -> dict:
    """Closed loop with `concurrency` aiohttp clients in this process; latency and CPU over
    [warm_s, warm_s + window_s]."""
    url = target.url + "/v1/completions"
    win, stop = Window(), asyncio.Event()
    body = target.body or BODIES[target.stream]
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    routes: dict[str, int] = {}  # pd-router's decisions in the window (x-pd-route)
    sent = 0
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     skip_auto_headers=("User-Agent",)) as session:
        async def client() -> None:
            nonlocal sent
            while not stop.is_set():
                sent += 1
                t0 = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=HEADERS) as resp:
                        payload = await resp.read()  # streaming: the whole SSE stream, to its end
                        route = resp.headers.get("x-pd-route")
                        ok = resp.status == 200 and b'"choices"' in payload and (
                            not target.stream or payload.rstrip().endswith(SSE_END))
                        problem = None if ok else f"HTTP {resp.status}: {payload[:200]!r}"
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    problem = f"{type(exc).__name__}: {exc}"
                t1 = time.perf_counter()
                if problem is not None:
                    errors[problem] += 1
                    await asyncio.sleep(0.01)  # do not spin on a dead target
                elif win.start is not None and t1 >= win.start and (win.end is None or t1 <= win.end):
                    latencies.append(t1 - t0)
                    if route and (m := ROUTE_RE.search(route)):
                        routes[m[1]] = routes.get(m[1], 0) + 1

        tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
        try:
            await asyncio.sleep(warm_s)
            cpu_win = CpuWindow(target)
            win.start = time.perf_counter()
            await asyncio.sleep(window_s)
            win.end = time.perf_counter()
            cpu = cpu_win.stop(win.end - win.start)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
    n = len(latencies)
    pcts = (percentile(latencies, 50) * 1e3, percentile(latencies, 99) * 1e3) if n else (None, None)
    return result(n, sent, errors, win.end - win.start, pcts, cpu, routes)


def wrk_ms(value: str, unit: str) -> float:
    return float(value) * WRK_UNITS_MS[unit]


def parse_wrk(out: str) -> dict:
    """wrk's summary (with --latency): completed requests, run time, p50/p99 in ms, non-2xx/3xx
    responses and socket errors. ValueError if there is no summary."""
    total = re.search(rf"(\d+) requests in {WRK_TIME}", out)
    if total is None:
        raise ValueError(f"no wrk summary in: {out[-500:]!r}")
    pcts = {p: wrk_ms(v, u) for p, v, u in re.findall(rf"^\s*(50|99)(?:\.0+)?%\s+{WRK_TIME}", out, re.M)}
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {"requests": int(total[1]), "duration_s": wrk_ms(total[2], total[3]) / 1e3,
            "p50_ms": pcts.get("50"), "p99_ms": pcts.get("99"),
            "non2xx": int(non2xx[1]) if non2xx else 0,
            "socket_errors": dict(zip(("connect", "read", "write", "timeout"),
                                      map(int, sock.groups()))) if sock else {}}


def pd_router_decisions(target: Target) -> dict[str, float] | None:
    """pd-router's answered requests by decision (its /metrics counter), None for other targets."""
    if not isinstance(target.proc, RouterProcess):
        return None
    try:
        text = requests.get(target.url + "/metrics", timeout=10).text
    except requests.RequestException:
        return None  # a dead router shows in the run's errors
    out: dict[str, float] = {}
    for labels, value in REQUESTS_SERIES_RE.findall(text):
        lab = dict(LABEL_RE.findall(labels))
        if lab.get("outcome") == "ok":
            out[lab["decision"]] = out.get(lab["decision"], 0.0) + float(value)
    return out


def run_wrk(target: Target, concurrency: int, seconds: int, lua: Path) -> subprocess.CompletedProcess:
    cmd = pinned(["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "--latency", "-s", str(lua),
                  target.url + "/v1/completions"], LOAD_CPU)
    env = {**os.environ, "WRK_BODY": (target.body or BODIES[target.stream]).decode()}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds + 60)


def window_at(concurrency: int, window_s: float) -> float:
    """The measured window at this concurrency. A closed loop starts all its connections at once, so
    a window's first `concurrency` requests arrive together and, at 64 connections, wait out a
    burst on the mock engines' core (100-250 ms each, every target alike: by hand, 2026-12-06,
    docs/benchmarks.md). Under 1% of a 4 s window's requests, they were its p99, which then swung
    between 50 and 160 ms from run to run; in twice the window they are under half a percent, and
    the p99 is the steady tail (48-51 ms in 4 runs)."""
    return window_s * 2 if concurrency >= 64 else window_s


def measure_wrk(target: Target, concurrency: int, warm_s: float, window_s: float, lua: Path) -> dict:
    """wrk on core 1: a warm-up run (not counted), then the measured run; the router's CPU over
    the measured run divided by its successful requests. No per-response body check (wrk only
    counts non-2xx/3xx statuses); a stream is read to its end, so latency is the whole response."""
    if round(warm_s) > 0:
        run_wrk(target, concurrency, round(warm_s), lua)
    before = pd_router_decisions(target)
    cpu_win, t0 = CpuWindow(target), time.perf_counter()
    proc = run_wrk(target, concurrency, max(1, round(window_s)), lua)
    cpu = cpu_win.stop(time.perf_counter() - t0)
    after = pd_router_decisions(target)
    try:
        w = parse_wrk(proc.stdout)
    except ValueError:
        problem = f"wrk exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}"
        return result(0, 0, Counter({problem: 1}), 1.0, (None, None), cpu, {})
    errors = Counter({"non-2xx/3xx responses": w["non2xx"]})
    errors.update({f"socket {kind} errors": k for kind, k in w["socket_errors"].items()})
    routes = ({d: int(after.get(d, 0) - before.get(d, 0)) for d in after}
              if before is not None and after is not None else {})
    n = w["requests"] - w["non2xx"]
    return result(n, w["requests"], errors, w["duration_s"], (w["p50_ms"], w["p99_ms"]), cpu,
                  {d: k for d, k in routes.items() if k})


# -- summary --------------------------------------------------------------------------------
def spread(by_repeat: list[float | None]) -> dict | None:
    """Median, min and max over the repeats that measured it; `by_repeat` keeps each repeat's
    value in its place (None: not measured) for the comparisons made repeat by repeat."""
    values = [v for v in by_repeat if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values, "by_repeat": list(by_repeat)}


def pooled(values: list[float | None]) -> dict | None:
    """spread() over values of many targets and repeats: no order to keep."""
    s = spread(values)
    if s is not None:
        del s["by_repeat"]
    return s


def with_repeats(summary: dict, repeats: int) -> dict:
    """A summary saved before its spreads kept `by_repeat` (before a669d8e), for --render: CPU
    from the list it kept apart, the rest from `values` where no repeat is missing."""
    for by_c in summary.values():
        for cell in by_c.values():
            for metric, s in cell.items():
                if isinstance(s, dict) and "values" in s and "by_repeat" not in s:
                    if metric == "cpu_us" and "cpu_us_by_repeat" in cell:
                        s["by_repeat"] = cell["cpu_us_by_repeat"]
                    elif len(s["values"]) == repeats:
                        s["by_repeat"] = s["values"]
    return summary


def summarize(targets: list[Target], runs: dict[tuple[str, int], list[dict]]) -> dict:
    out: dict[str, dict[str, dict]] = {}
    for t in targets:
        out[t.key] = {}
        for c in CONCURRENCY:
            reps = runs.get((t.key, c), [])
            if not reps:
                continue
            direct = runs.get((mode_key("direct", t.stream), c), [])
            added50, added99 = [], []
            for r, rep in enumerate(reps):  # paired with the direct run of the same repeat and mode
                base = direct[r] if r < len(direct) else None
                paired = t.base != "direct" and base and base["p50_ms"] is not None \
                    and rep["p50_ms"] is not None
                added50.append(rep["p50_ms"] - base["p50_ms"] if paired else None)
                added99.append(rep["p99_ms"] - base["p99_ms"] if paired else None)
            out[t.key][str(c)] = {
                "rps": spread([r["rps"] for r in reps]),
                "p50_ms": spread([r["p50_ms"] for r in reps]),
                "p99_ms": spread([r["p99_ms"] for r in reps]),
                "added_p50_ms": spread(added50), "added_p99_ms": spread(added99),
                "cpu_us": spread([r["cpu_us"] for r in reps]),
                "errors": sum(r["errors"] for r in reps), "requests": sum(r["n"] for r in reps),
                "routes": {k: sum(r.get("routes", {}).get(k, 0) for r in reps)
                           for k in sorted({k for r in reps for k in r.get("routes", {})})},
                "error_samples": sorted({e for r in reps for e in r["error_samples"]})[:5],
            }
    return out


def fmt(s: dict | None, digits: int = 2, signed: bool = False) -> str:
    if s is None:
        return "—"
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    if len(s["values"]) == 1:
        return f.format(s["median"])
    return f"{f.format(s['median'])} ({f.format(s['min'])}–{f.format(s['max'])})"


def ratio_value(a: dict | None, b: dict | None) -> float | None:
    if a is None or b is None or b["median"] <= 0:
        return None
    return a["median"] / b["median"]


def ratio(a: dict | None, b: dict | None) -> str:
    v = ratio_value(a, b)
    return "—" if v is None else f"{v:.2f}×"


def mode_name(stream: bool) -> str:
    return "streaming" if stream else "non-streaming"


def cell(summary: dict, key: str, c: int, metric: str) -> dict | None:
    return summary.get(key, {}).get(str(c), {}).get(metric)


def local_share(s: dict) -> str:
    """The share of requests pd-router prefilled on the decode itself (x-pd-route route=local)."""
    routes = s.get("routes") or {}
    total = sum(routes.values())
    return f"{routes.get('local', 0) / total * 100:.0f}%" if total else "—"


LOADGEN_DESC = {
    "wrk": "`wrk`, C, one thread: `taskset -c 1 wrk -t1 -cN -dNs --latency -s post.lua`, the Lua "
           "script POSTs the body",
    "aiohttp": "an aiohttp closed loop in the benchmark process, uvloop"}
WARM_DESC = {"wrk": "a wrk warm-up run", "aiohttp": "ramp-up"}
CHECK_DESC = {
    "wrk": "wrk counts non-2xx/3xx responses and socket errors as errors but does not check bodies; "
           "it reads a chunked (streaming) answer to its end, so a stream's latency is the whole "
           "response. \"served local\" is the change in pd-router's `pd_router_requests_total"
           "{decision=...}` counter (`/metrics`, read outside the window) over the run.",
    "aiohttp": "Every response is checked (HTTP 200 with `choices`; a stream must end with "
               "`data: [DONE]`); \"served local\" counts pd-router's `x-pd-route` headers."}


def loadgen_notes(meta: dict) -> list[str]:
    """Which load generator ran, how the two harnesses differ, and this run's core load."""
    loadgen = meta.get("loadgen", "aiohttp")  # results from before --loadgen: aiohttp
    other = "aiohttp" if loadgen == "wrk" else "wrk"
    busy = meta.get("core_busy_c64") or {}
    load, router = busy.get("load_core_pct"), busy.get("router_pct")
    this_run = (f" In this run, at concurrency 64, core 1 was {load['median']:.0f}% busy and the "
                f"routers {router['median']:.0f}% of core 0 (medians over the router rows; ranges "
                f"{load['min']:.0f}–{load['max']:.0f}% and {router['min']:.0f}–{router['max']:.0f}%)."
                if load and router else "")
    if meta.get("engines", "mock") == "fast":
        return [f"- Load generator: `{loadgen}` (`--loadgen {other}` for the other harness). With "
                "wrk and the fast engines, a router's core is meant to saturate before core 1: "
                "CPU per request is then taken under the router's own load, and p99 at "
                "concurrency 64 is mostly the router's own queueing (issue 30's 'tail at "
                "saturation'; a router whose p99 is many times its p50 stalls, it does not "
                "queue). The aiohttp client (Python) costs core 1 more than the fast engines do, "
                "so with it core 1 saturates first again." + this_run]
    return [f"- Load generator: `{loadgen}` (`--loadgen {other}` for the other harness). With the "
            "aiohttp client, core 1 (the Python client plus both Python mock engines) is the "
            "bottleneck at every concurrency, so every router gets about the same requests/s, its "
            "CPU per request is taken at partial router load (fewer requests per wake-up, so more "
            "µs each) and p99 is mostly core 1's queueing. wrk (C) needs a fraction of that CPU, so "
            "core 1 goes mostly to the mock engines and the routers get more requests/s: CPU per "
            "request is taken under more router load (lower, as in the issue's own wrk numbers) and "
            "p99 at concurrency 64 includes more of the router's own queueing; where core 1 still "
            "saturates (the mock engines), the routers stay short of their own limit. Compare routers "
            "within one harness, CPU/request first." + this_run]


def engines_note(meta: dict) -> str:
    """Which mock engines ran (--engines), and what that does to core 1."""
    mock = ("`pd-mock-engine` (`--engines mock`: aiohttp, a side-channel request per transfer) "
            "saturates core 1 near 2,200 PD requests/s, below every router's own limit, so that "
            "the p99 at concurrency 64 is core 1's queueing, not the routers'")
    if meta.get("engines", "mock") == "fast":  # results from before --engines: pd-mock-engine
        return ("- Engines: `bench/fast_engine.py` (`--engines fast`, the default): the four mock "
                "engines in one process, answering from protocol callbacks (uvloop, httptools, "
                "answers built once; a vLLM prefill answers a PdNixl prefill's kv_transfer_params "
                "with its `pd` section, an SGLang decode waits for its room's prefill, in "
                f"process), so that the engines' core does not saturate before the routers' does. {mock}.")
    return f"- Engines: {mock}."


def markdown(meta: dict, targets: list[dict], summary: dict) -> str:
    loadgen = meta.get("loadgen", "aiohttp")
    lines = [f"<!-- {SECTION}:start -->", "## Router overhead", "",
             "What a PD router costs per request: pd-router against the Rust routers that ship with vLLM "
             "(`vllm-router`) and SGLang (`sglang-router`), all on the same mock engines "
             f"({ENGINE_NAMES[meta.get('engines', 'mock')]}; workload below), "
             "non-streaming and streaming (`\"stream\": true`: the load generator reads the SSE stream "
             "to its end, and latency is the whole response's). Every request is disaggregated (round "
             "robin, one prefill and one decode engine), except in the row \"pd-router (vLLM pull, "
             "default policy)\": pd-router's default policy prefills prompts under 1024 uncached tokens "
             "on the decode worker, so this repeated short prompt is served on the decode alone (column "
             "\"served local\"; see Method for how it is counted). The routers' own health checks "
             "and metric scrapes are turned off or set to an hour so that only request work is counted. "
             "A reference row, `bench/naive_proxy.py` (non-streaming only), is the least an aiohttp PD "
             "proxy can do (prefill, then decode, relay; no policy, metrics, timeouts or failover): the "
             "floor under any aiohttp-based router on this machine. A second one, "
             "`bench/floor_proxy.py` (both modes), is the least any Python PD proxy can cost: the "
             "same flow on uvloop and httptools with plain protocol callbacks (no coroutine, task or "
             "future per request): how far below the Rust routers Python can go here.", "",
             f"Rerun: `make bench-router` (or `.venv/bin/python -m bench.router_overhead [--quick] "
             "[--repeats N] [--streaming both|off|only] [--loadgen wrk|aiohttp] "
             f"[--engines fast|mock]`). This run: `{meta['command']}`, {meta['date']}, "
             f"{meta['runtime_s'] / 60:.1f} min.", "",
             f"- Machine: {meta['machine']}.",
             f"- Workload: a ~60-token prompt, {meta.get('max_tokens', MAX_TOKENS)} output tokens "
             "(`max_tokens`), zero prefill time, "
             + (f"the mock decode {meta['tpot_ms']:g} ms per token (a stream comes token by token)."
                if meta.get("tpot_ms") else "zero decode time (the mocks send an answer at once)."),
             "- Pinning: each router alone on core 0; the mock prefill and decode engines and the "
             f"load generator ({LOADGEN_DESC[loadgen]}) share core 1.",
             engines_note(meta),
             f"- Versions: {meta['versions']}.",
             *hot_path_note(meta),
             f"- Method: closed loop with 1, 16 and 64 concurrent clients (connections); per "
             f"measurement {meta['warm_s']:g} s of {WARM_DESC[loadgen]} (not counted), then a "
             f"{meta['window_s']:g} s window ({window_at(64, meta['window_s']):g} s at concurrency "
             "64: the clients' synchronized start stays out of its p99, see `window_at`). "
             f"{meta['repeats']} repeat(s), targets and modes "
             "interleaved within each repeat (order rotated) to spread the machine's noise; each cell "
             f"is the median over repeats with the min–max in brackets. {CHECK_DESC[loadgen]}",
             "- CPU µs/request: the router process's utime + stime (`/proc/PID/stat`, all threads) "
             "over the window divided by the requests completed in it.",
             *loadgen_notes(meta),
             f"- Other load: core 0 was busy with processes other than the router for "
             f"{noise_note(meta)} of each window (`/proc/stat`); the machine is shared, so expect "
             "some spread between runs. Ratios between targets are steadier than absolute numbers, "
             "since the targets are interleaved.",
             "- Added p50/p99: the target's latency percentile minus the direct-to-decode one of the "
             "same repeat, concurrency and mode. It includes the prefill leg and the KV hand-off of the "
             "PD flow, not only router code (vllm-router and pd-router's vLLM flow run the legs one "
             "after the other; sglang-router and pd-router's SGLang flow run them together).", ""]
    ncols = 13
    lines += ["| target | mode | conc. | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | "
              "router CPU µs/req | CPU vs vllm-router | CPU vs sglang-router | served local | errors |",
              "|---|---|" + "---:|" * (ncols - 2)]
    for t in targets:
        stream = t.get("stream", False)
        rows = summary.get(t["key"], {})
        if t.get("broken"):
            cells = [t["label"], mode_name(stream), "—", f"skipped: {t['broken']}"] + [""] * (ncols - 4)
            lines.append("| " + " | ".join(cells) + " |")
            continue
        for c in CONCURRENCY:
            s = rows.get(str(c))
            if s is None:
                continue
            vr = cell(summary, mode_key("vllm-router", stream), c, "cpu_us")
            sr = cell(summary, mode_key("sglang-router", stream), c, "cpu_us")
            lines.append(
                f"| {t['label']} | {mode_name(stream)} | {c} | {fmt(s['rps'], 0)} | {fmt(s['p50_ms'])} | "
                f"{fmt(s['p99_ms'])} | {fmt(s['added_p50_ms'], signed=True)} | "
                f"{fmt(s['added_p99_ms'], signed=True)} | {fmt(s['cpu_us'], 0)} | "
                f"{ratio(s['cpu_us'], vr)} | {ratio(s['cpu_us'], sr)} | {local_share(s)} | "
                f"{s['errors']} / {s['requests']} |")
    lines.append("")
    lines += ratio_table(targets, summary)
    lines += ["", "Done when (issue 30; judged on the medians of this run. \"Met in k of n repeats\" "
              "judges each repeat alone, against the Rust routers' runs of the same repeat (all "
              "targets at one concurrency back to back, one to three minutes from first to last): "
              "CPU against 0.8× vllm-router's, latency against the better of the two in that repeat. A "
              "verdict that holds in only some repeats is within this machine's noise, not settled "
              "by the run):", ""]
    lines += [f"- [{'x' if ok else ' '}] {verdict_word(ok)}: {text}" for ok, text in checks(summary)]
    lines.append("")
    lines += comparison(summary)
    lines += paired_lines(targets, summary)
    if meta.get("plots"):
        lines += ["", "![Router CPU per request](img/router_cpu_per_request.png)", "",
                  "![Added latency vs direct](img/router_added_latency.png)"]
    else:
        lines += ["", f"(No plots this run: {meta.get('plot_problem', 'matplotlib unavailable')}.)"]
    errors = [(t["label"], mode_name(t.get("stream", False)), c,
               summary[t["key"]][str(c)]["error_samples"]) for t in targets
              if t["key"] in summary for c in CONCURRENCY
              if str(c) in summary[t["key"]] and summary[t["key"]][str(c)]["errors"]]
    if errors:
        lines += ["", "Errors seen:", ""]
        lines += [f"- {label} ({mode}) at {c}: {'; '.join(samples)}" for label, mode, c, samples in errors]
    lines.append(f"<!-- {SECTION}:end -->")
    return "\n".join(lines) + "\n"


def ratio_table(targets: list[dict], summary: dict) -> list[str]:
    """pd-router's rows against both Rust routers of the same mode: ratios of the medians."""
    head = ["pd-router against the Rust routers of the same run and mode (ratio of medians; each "
            "cell: vs vllm-router / vs sglang-router; below 1× is pd-router better):", "",
            "| pd-router | mode | CPU/req c=1 | CPU/req c=16 | CPU/req c=64 | p99 c=64 | added p50 c=1 |",
            "|---|---|---:|---:|---:|---:|---:|"]
    rows = []
    for t in targets:
        if not t["key"].startswith("pd-") or t["key"] not in summary:
            continue
        stream = t.get("stream", False)
        peers = [mode_key(p, stream) for p in ("vllm-router", "sglang-router")]

        def pair(c: int, metric: str) -> str:
            return " / ".join(ratio(cell(summary, t["key"], c, metric), cell(summary, p, c, metric))
                              for p in peers)
        rows.append(f"| {t['label']} | {mode_name(stream)} | " + " | ".join(
            [pair(c, "cpu_us") for c in CONCURRENCY] + [pair(64, "p99_ms"), pair(1, "added_p50_ms")])
            + " |")
    return head + rows if rows else []


def by_repeat(s: dict | None) -> list[float | None]:
    return (s or {}).get("by_repeat", [])


def repeats_met(ours: dict, goals: list[dict], factor: float = 1.0) -> str:
    """In how many repeats ours was at most factor x the best of `goals` measured in the same
    repeat (a repeat runs every target at one concurrency back to back, one to three minutes
    from first to last, so the machine's drift between repeats moves them together): 'met in k of n
    repeats', or '' with one repeat. A repeat where no goal was measured is not counted."""
    met = n = 0
    for r, value in enumerate(by_repeat(ours)):
        goal = [g[r] for g in map(by_repeat, goals) if r < len(g) and g[r] is not None]
        if value is None or not goal:
            continue
        n += 1
        met += value <= factor * min(goal)
    return f"met in {met} of {n} repeats" if n > 1 else ""


def checks(summary: dict) -> list[tuple[bool | None, str]]:
    """Issue 30's goals for each CHECKED row and mode: (met, the numbers); met None: not measured."""
    out: list[tuple[bool | None, str]] = []
    for base, label in CHECKED:
        for stream in (False, True):
            key = mode_key(base, stream)
            if key not in summary:
                continue
            where = f"{label}, {mode_name(stream)}"
            vr = mode_key("vllm-router", stream)
            parts, oks = [], []
            for c in CONCURRENCY:
                a, b = cell(summary, key, c, "cpu_us"), cell(summary, vr, c, "cpu_us")
                if a is None or b is None:
                    parts.append(f"{c}: not measured")
                    oks.append(None)
                    continue
                oks.append(a["median"] <= CPU_GOAL * b["median"])
                repeats = repeats_met(a, [b], CPU_GOAL)
                parts.append(f"{c}: {ratio(a, b)} ({a['median']:.0f} vs {b['median']:.0f} µs"
                             f"{'; ' + repeats if repeats else ''})")
            out.append((all_met(oks), f"{where}: CPU per request at most {CPU_GOAL:g}× vllm-router's at "
                        f"concurrency 1, 16, 64: " + "; ".join(parts)))
            for c, metric, what, unit in ((64, "p99_ms", "p99 at concurrency 64", "ms"),
                                          (1, "added_p50_ms", "added p50 at concurrency 1", "ms")):
                out.append(no_worse_than_best(summary, key, stream, c, metric, f"{where}: {what}"))
    return out


def no_worse_than_best(summary: dict, key: str, stream: bool, c: int, metric: str,
                       what: str) -> tuple[bool | None, str]:
    ours = cell(summary, key, c, metric)
    peers = {p: cell(summary, mode_key(p, stream), c, metric) for p in ("vllm-router", "sglang-router")}
    measured = {p: s for p, s in peers.items() if s is not None}
    text = f"{what} no worse than the better Rust router's"
    if ours is None or not measured:
        return None, f"{text}: not measured"
    best = min(measured, key=lambda p: measured[p]["median"])
    numbers = ", ".join(f"{p} {s['median']:.2f}" for p, s in measured.items())
    missing = [p for p, s in peers.items() if s is None]
    repeats = repeats_met(ours, list(measured.values()))
    note = ", " + repeats if repeats else ""
    return (ours["median"] <= measured[best]["median"],
            f"{text}: {ours['median']:.2f} ms vs {numbers} ms{note}"
            + (f" ({', '.join(missing)} not measured)" if missing else ""))


def all_met(oks: list[bool | None]) -> bool | None:
    if any(ok is False for ok in oks):
        return False
    return None if any(ok is None for ok in oks) else True


def verdict_word(ok: bool | None) -> str:
    return {True: "met", False: "not met", None: "not measured"}[ok]


def comparison(summary: dict) -> list[str]:
    """pd-router (vLLM pull) against the naive aiohttp proxy (non-streaming)."""
    out = []
    if "pd-vllm" in summary and "naive" in summary:
        parts, cheaper = [], True
        for c in CONCURRENCY:
            a, b = cell(summary, "pd-vllm", c, "cpu_us"), cell(summary, "naive", c, "cpu_us")
            if a and b:
                parts.append(f"{c}: {a['median'] - b['median']:+.0f} µs ({ratio(a, b)})")
                cheaper = cheaper and a["median"] < b["median"]
        if parts:
            out.append("- pd-router (vLLM pull, with its policy, metrics, timeouts and failover) against the "
                       "naive aiohttp proxy, CPU per request by concurrency: " + "; ".join(parts) + "."
                       + (" pd-router's legs run on its own httptools client (see \"Choosing the "
                          "router's HTTP stack\" below), which is why it costs less than the naive proxy."
                          if cheaper else ""))
    for stream in (False, True):
        mode = mode_name(stream)
        ours, floor, peer = (mode_key(k, stream) for k in ("pd-vllm", "floor", "vllm-router"))
        parts = []
        for c in CONCURRENCY:
            a, b, v = (cell(summary, k, c, "cpu_us") for k in (ours, floor, peer))
            if a and b and v:
                parts.append(f"{c}: pd-router {a['median']:.0f}, floor {b['median']:.0f} "
                             f"({ratio(b, v)} vllm-router's {v['median']:.0f})")
        if parts:
            out.append(f"- {mode}, CPU µs per request, pd-router (vLLM pull) and the Python floor "
                       "proxy: " + "; ".join(parts) + ". The difference is what pd-router does per "
                       "request beyond moving bytes (coroutines and their task, request checks, "
                       "policy, accounting, metrics, timeouts, failover); \"Router hot path "
                       "profile\" below shows where.")
    return out


def paired_ratio(a: dict | None, b: dict | None) -> str:
    """CPU per request of cell `a` over cell `b` (two rows' summaries at one concurrency), repeat
    by repeat where both measured it: median (min–max). The rows of a repeat run back to back,
    seconds apart, so this is steadier than the ratio of medians when the machine drifts between
    repeats; an A/B (--tree, lean) reads it."""
    if not a or not b:
        return "—"
    r = sorted(x / y for x, y in zip(by_repeat(a.get("cpu_us")), by_repeat(b.get("cpu_us")))
               if x is not None and y)
    if not r:
        return "—"
    return f"{statistics.median(r):.2f}× ({r[0]:.2f}–{r[-1]:.2f})"


def paired_lines(targets: list[dict], summary: dict) -> list[str]:
    """The A/B rows (another checkout's pd-router, the lean router) against this checkout's
    pd-router (vLLM pull), repeat by repeat."""
    out = []
    for t in targets:
        base = base_key(t["key"])
        if not (base == "lean" or base.startswith("pd-vllm@")) or t["key"] not in summary:
            continue
        ours = mode_key("pd-vllm", t.get("stream", False))
        parts = [f"{c}: {paired_ratio(summary[t['key']].get(str(c)), summary.get(ours, {}).get(str(c)))}"
                 for c in CONCURRENCY]
        out.append(f"- {t['label']}, {mode_name(t.get('stream', False))}: CPU per request over this "
                   "checkout's pd-router (vLLM pull) of the same repeat, median (min–max) by "
                   "concurrency: " + "; ".join(parts) + ".")
    return out


def noise_note(meta: dict) -> str:
    s = meta.get("foreign_pct")
    if not s:
        return "an unknown share"
    return f"a median {s['median']:.1f}% (max {s['max']:.0f}%)"


# -- the run --------------------------------------------------------------------------------
def hot_path_note(meta: dict) -> list[str]:
    """What the pd-router rows ran: the hot path compiled (pd_plugins/routers/native.py) or not."""
    ran = meta.get("hot_path") or {}
    if not ran:
        return []
    return ["- pd-router's hot path: " + "; ".join(f"{key}: {said}" for key, said in ran.items())
            + ". Compiled with mypyc where a build of its sources exists (`make bootstrap` "
              "builds it; docs/router.md, \"Native hot path\"); the row \"interpreted\" is the "
              "same code with `PD_ROUTER_NATIVE=0`."]


def versions(peers: dict[str, str | None]) -> str:
    def v(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "?"
    parts = [f"pd-plugins {v('pd-plugins')} (git {common.git_rev()})",
             # the build matters as much as the version (docs/development.md, "Environment")
             f"Python {platform.python_version()} (from {sys.base_prefix})",
             f"aiohttp {v('aiohttp')}", f"uvloop {v('uvloop')}"]
    parts += [f"{d} {ver}" if ver else f"{d} not installed" for d, ver in peers.items()]
    return ", ".join(parts)


def start_checked(procs: list[ManagedProcess], timeout: float = 60.0) -> list[str]:
    """Start each, wait for each; the names of those that failed (already stopped)."""
    failed = []
    for p in procs:
        try:
            p.start()
        except OSError as exc:
            print(f"  {p.name}: cannot start: {exc}", flush=True)
            failed.append(p.name)
    for p in procs:
        if p.name in failed:
            continue
        try:
            p.wait_healthy(timeout)
        except (RuntimeError, TimeoutError) as exc:
            print(f"  {p.name} did not come up; skipping it. {exc}", flush=True)
            p.stop()
            failed.append(p.name)
    return failed


def publish(results: Path, meta: dict, target_info: list[dict], summary: dict, can_plot: bool,
            docs: bool = True) -> None:
    """Plots and the section, from one run's numbers: into docs/img/ and docs/benchmarks.md, or
    (docs False) beside results.json (section.md), leaving docs/ as it is."""
    img = IMG if docs else results.parent
    if can_plot:
        img.mkdir(parents=True, exist_ok=True)
        res = subprocess.run([str(PEERS_PY), str(ROOT / "bench" / "router_overhead_plot.py"),
                              str(results), str(img)], capture_output=True, text=True)
        meta["plots"] = res.returncode == 0
        if res.returncode != 0:
            meta["plot_problem"] = "plotting failed"
            print(f"plotting failed:\n{res.stderr[-2000:]}", flush=True)
        else:
            print(res.stdout.strip(), flush=True)
    section = markdown(meta, target_info, summary)
    if docs:
        common.write_section(SECTION, section)
        print(f"wrote {DOC.relative_to(ROOT)}", flush=True)
    else:
        (results.parent / "section.md").write_text(section)
        print(f"wrote {(results.parent / 'section.md').relative_to(ROOT)} (docs/ untouched)", flush=True)
    print(section, flush=True)


def print_checks(summary: dict) -> None:
    print("Done when (issue 30), on this run's medians:", flush=True)
    for ok, text in checks(summary):
        print(f"  {verdict_word(ok).upper():12s} {text}", flush=True)


def render(results: Path) -> int:
    """--render: rewrite the docs section and plots from a saved results.json (no measuring)."""
    raw = json.loads(results.read_text())
    summary = with_repeats(raw["summary"], raw["meta"]["repeats"])
    _, can_plot = ensure_peers_venv()
    publish(results, raw["meta"], raw["targets"], summary, can_plot)
    print_checks(summary)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, short windows (~2.5 min)")
    ap.add_argument("--repeats", type=int,
                    help="measurements per target, mode and concurrency (default 3; 1 with --quick)")
    ap.add_argument("--window-s", type=float,
                    help="measured window per measurement in s (default 4; 1.5 with --quick, "
                         "rounded to whole seconds for wrk)")
    ap.add_argument("--loadgen", choices=LOADGENS,
                    help="load generator on core 1: wrk (the default where installed) or this "
                         "process's aiohttp closed loop (checks every response body)")
    ap.add_argument("--streaming", choices=sorted(STREAMING), default="both",
                    help="non-streaming and streaming requests (both, the default), or one of them")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                    help=f"tokens per answer (default {MAX_TOKENS}); with --tpot-ms, a streamed answer "
                         "comes token by token; either one off its default implies --no-docs")
    ap.add_argument("--engines", choices=ENGINE_KINDS, default="fast",
                    help="the mock engines on core 1: bench/fast_engine.py (fast, the default) "
                         "or pd-mock-engine (mock); the published section says what each costs")
    ap.add_argument("--tpot-ms", type=float, default=0.0,
                    help="the mock decode's time per output token (default 0: the answer at once; "
                         "with --engines mock only)")
    ap.add_argument("--targets", nargs="+", metavar="KEY",
                    help="only these rows (and the direct baseline): pd-vllm, pd-vllm-default, "
                         "vllm-router, pd-sglang, sglang-router, naive, floor, and lean (only when "
                         "named: pd-router's per-request work on the floor's I/O, "
                         "bench/lean_router.py); a partial run writes its own results but never "
                         "docs/ (implies --no-docs)")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="another checkout's pd-router (vLLM pull) as a row of its own beside this "
                         "one's, e.g. a git worktree: an A/B in CPU time (implies --no-docs)")
    ap.add_argument("--no-docs", action="store_true",
                    help="do not touch docs/: the section (section.md) and plots go beside results.json")
    ap.add_argument("--render", type=Path, metavar="RESULTS_JSON",
                    help="only rewrite docs/ from a saved bench/results/.../results.json")
    args = ap.parse_args()
    if args.render:
        return render(args.render)
    if args.tpot_ms and args.engines != "mock":
        ap.error("--tpot-ms needs --engines mock (the fast engines answer at once)")
    if args.targets or args.tree or args.max_tokens != MAX_TOKENS or args.tpot_ms:
        args.no_docs = True  # the published section is the whole comparison, never a part of it
    BODIES.update(request_bodies(args.max_tokens))
    engine_args = ("--ttft-ms", "0", "--tpot-ms", f"{args.tpot_ms:g}")
    repeats = args.repeats or (1 if args.quick else 3)
    # 13 target-mode rows x 3 concurrencies x 3 repeats x 5 s (9 s at 64): about 13 minutes.
    window_s = args.window_s or (1.5 if args.quick else 4.0)
    warm_s = 0.5 if args.quick else 1.0
    loadgen = args.loadgen or ("wrk" if shutil.which("wrk") else "aiohttp")
    if loadgen == "wrk":
        if not shutil.which("wrk"):
            sys.exit("router_overhead: --loadgen wrk, but wrk is not installed (apt-get install wrk)")
        window_s, warm_s = max(1, round(window_s)), max(1, round(warm_s))  # wrk: whole seconds
    elif args.loadgen is None:
        print("note: wrk not found, so the load generator is aiohttp in this process; it saturates "
              "core 1 before the routers do (apt-get install wrk for the default)", flush=True)
    began = time.monotonic()

    # Load generator (this process) on core 1 with the engines; routers get core 0 to themselves.
    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        sys.exit("router_overhead: needs Linux with at least 2 cores (router on 0, load on 1)")
    os.sched_setaffinity(0, {int(LOAD_CPU)})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop our processes on the way out

    peers, can_plot = ensure_peers_venv()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = RESULTS_DIR / stamp
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs and raw results: {run_dir.relative_to(ROOT)}; load generator: {loadgen}", flush=True)
    lua = run_dir / "post.lua"
    lua.write_text(WRK_LUA)

    def engine(name: str, role: str, kind: str) -> MockEngineProcess:
        return MockEngineProcess(name, role=role, engine=kind, args=engine_args, cpu=LOAD_CPU,
                                 log_dir=run_dir)

    vp, vd = engine("vllm-prefill", "prefill", "vllm"), engine("vllm-decode", "decode", "vllm")
    sp, sd = engine("sglang-prefill", "prefill", "sglang"), engine("sglang-decode", "decode", "sglang")
    fast = FastEngineProcess("fast-engines", ends=(vp, vd, sp, sd), cpu=LOAD_CPU, log_dir=run_dir)
    log_flags = ("--log-level", "warning", "--log-format", "text")
    router_flags = ("--policy", "round_robin", *log_flags)
    pd_vllm = RouterProcess("pd-router-vllm", prefill=[vp.worker_arg()], decode=[vd.worker_arg()],
                            args=("--engine", "vllm", "--transfer", "pull", *router_flags),
                            config=PD_ROUTER_CONFIG, cpu=ROUTER_CPU, log_dir=run_dir)
    pd_default = RouterProcess("pd-router-vllm-default", prefill=[vp.worker_arg()],
                               decode=[vd.worker_arg()],
                               args=("--engine", "vllm", "--transfer", "pull", *log_flags),
                               config=PD_ROUTER_CONFIG, cpu=ROUTER_CPU, log_dir=run_dir)
    # the same router with its hot path interpreted: what the compile buys (routers/native.py)
    pd_interpreted = like(pd_vllm, RouterProcess, "pd-router-vllm-interpreted")
    pd_interpreted.env = {native.SWITCH: "0"}
    pd_sglang = RouterProcess("pd-router-sglang", prefill=[sp.worker_arg()], decode=[sd.worker_arg()],
                              args=("--engine", "sglang", *router_flags),
                              config=PD_ROUTER_CONFIG, cpu=ROUTER_CPU, log_dir=run_dir)
    vllm_router = PeerRouterProcess("vllm-router", kind="vllm", prefill=vp, decode=vd, cpu=ROUTER_CPU,
                                    log_dir=run_dir)
    sglang_router = PeerRouterProcess("sglang-router", kind="sglang", prefill=sp, decode=sd,
                                      cpu=ROUTER_CPU, log_dir=run_dir)
    naive = ReferenceProxyProcess("naive-proxy", prefill=vp, decode=vd, cpu=ROUTER_CPU, log_dir=run_dir)
    floor = ReferenceProxyProcess("floor-proxy", module="bench.floor_proxy", prefill=vp, decode=vd,
                                  cpu=ROUTER_CPU, log_dir=run_dir)

    rows = [("direct", "direct to decode (no router)", vd.url, None),
            ("pd-vllm", "pd-router (vLLM pull)", pd_vllm.url, pd_vllm),
            ("pd-vllm-default", "pd-router (vLLM pull, default policy)", pd_default.url, pd_default),
            ("pd-vllm-interpreted", "pd-router (vLLM pull, interpreted)", pd_interpreted.url,
             pd_interpreted),
            ("vllm-router", "vllm-router", vllm_router.url, vllm_router),
            ("pd-sglang", "pd-router --engine sglang", pd_sglang.url, pd_sglang),
            ("sglang-router", "sglang-router", sglang_router.url, sglang_router),
            ("naive", "naive aiohttp proxy (reference)", naive.url, naive),
            ("floor", "Python floor proxy (reference)", floor.url, floor)]
    if args.targets and "lean" in args.targets:  # a study, not part of the published comparison
        lean = like(pd_vllm, LeanRouterProcess, "lean-router")
        rows.append(("lean", "pd-router's work on the floor's I/O (reference)", lean.url, lean))
    if args.targets:
        unknown = set(args.targets) - {key for key, *_ in rows}
        if unknown:
            sys.exit(f"router_overhead: no target {sorted(unknown)}; "
                     f"targets: {', '.join(key for key, *_ in rows)}")
        rows = [row for row in rows if row[0] in args.targets or row[0] == "direct"]
    for spec in args.tree:
        name, _, path = spec.rpartition("=")
        name = name or Path(path).name
        other = like(pd_vllm, CheckoutRouter, f"pd-router-vllm-{name}")  # only the code differs
        other.tree = str(Path(path).resolve())
        rows.append((f"pd-vllm@{name}", f"pd-router (vLLM pull), {name}: git "
                     f"{common.git_rev(other.tree)}", other.url, other))
    # Mode-major, so that the table reads non-streaming first; the naive proxy and the lean router
    # do not stream.
    targets = [Target(mode_key(key, stream), label, url, proc, stream=stream)
               for stream in STREAMING[args.streaming] for key, label, url, proc in rows
               if not (stream and key in NON_STREAMING_ONLY)]
    routers: list[ManagedProcess] = [proc for key, _, _, proc in rows
                                     if proc is not None and key not in PEER_PINS
                                     and any(t.proc is proc for t in targets)]
    for peer, proc in (("vllm-router", vllm_router), ("sglang-router", sglang_router)):
        if not any(t.base == peer for t in targets):
            continue
        if peers.get(peer):
            routers.append(proc)
            continue
        for t in targets:
            if t.base == peer:
                t.broken = f"{peer} not installed"
        print(f"skipping {peer}: not installed in {PEERS_VENV.relative_to(ROOT)}", flush=True)
    engines: list[ManagedProcess] = [fast] if args.engines == "fast" else [vp, vd, *((sp, sd) if any(
        t.base in ("pd-sglang", "sglang-router") for t in targets) else ())]
    everything = [*engines, *routers]
    runs: dict[tuple[str, int], list[dict]] = {}
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    try:
        print(f"starting the engines ({args.engines}, core 1) and the routers (core 0)", flush=True)
        failed = start_checked(engines)
        if failed:
            raise RuntimeError(f"mock engines failed to start: {failed}")
        for name in start_checked(routers):
            for t in targets:
                if t.proc is not None and t.proc.name == name:
                    t.broken = "did not start (see its log)"
        live = [t for t in targets if not t.broken]
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            def one(t: Target, c: int, warm: float, window: float) -> dict:
                if loadgen == "wrk":
                    return measure_wrk(t, c, warm, window, lua)
                return runner.run(measure(t, c, warm, window))

            for t in live:  # warm-up: connections, caches, the router's first-request paths
                res = (one(t, 16, 0, 1) if loadgen == "wrk"
                       else one(t, 16, 0.5 if args.quick else 1.5, 0.5))
                print(f"warm-up {t.label:38s} {mode_name(t.stream):13s} {res['rps']:7.0f} req/s, "
                      f"{res['errors']} errors", flush=True)
                if res["n"] == 0:
                    t.broken = f"no successful request in warm-up ({'; '.join(res['error_samples'])})"
                    print(f"  skipping {t.label}: {t.broken}\n{t.proc.log_tail(20) if t.proc else ''}",
                          flush=True)
            live = [t for t in live if not t.broken]
            total = repeats * len(CONCURRENCY) * len(live)
            done = 0
            for r in range(repeats):
                for ci, c in enumerate(CONCURRENCY):
                    shift = (r * len(CONCURRENCY) + ci) % len(live)
                    for t in live[shift:] + live[:shift]:
                        if t.proc is not None and not t.proc.alive():
                            if not t.broken:
                                t.broken = "process died (see its log)"
                                print(f"{t.label} ({mode_name(t.stream)}) died:\n{t.proc.log_tail(20)}",
                                      flush=True)
                            continue
                        res = one(t, c, warm_s, window_at(c, window_s))
                        runs.setdefault((t.key, c), []).append(res)
                        done += 1
                        cpu = f"{res['cpu_us']:6.0f} µs/req CPU" if res["cpu_us"] is not None else " " * 15
                        p50 = f"{res['p50_ms']:7.2f}" if res["p50_ms"] is not None else "    n/a"
                        p99 = f"{res['p99_ms']:7.2f}" if res["p99_ms"] is not None else "    n/a"
                        noisy = (f"  (core {ROUTER_CPU} {res['foreign_pct']:.0f}% busy with other "
                                 "processes)" if res["foreign_pct"] > 5 else "")
                        print(f"[{done:3d}/{total}] repeat {r + 1} c={c:<3d} {t.label:38s} "
                              f"{'stream ' if t.stream else '       '}"
                              f"{res['rps']:6.0f} req/s  p50 {p50} ms  p99 {p99} ms  {cpu}  "
                              f"core {LOAD_CPU} {res['load_core_pct']:3.0f}%  "
                              f"errors {res['errors']}{noisy}", flush=True)
                        for e in res["error_samples"][:2]:
                            print(f"      error: {e}", flush=True)
        router_logs = {p.name: p.log_tail(40) for p in routers}
        ran = {t.base: hot_path(t.proc) for t in targets
               if isinstance(t.proc, RouterProcess) and t.proc.alive() and not t.stream}
    finally:
        for p in reversed(everything):
            p.stop()

    summary = summarize([t for t in targets if not t.broken], runs)
    meta = {
        "command": " ".join(["python -m bench.router_overhead", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": common.machine(), "versions": versions(peers), "repeats": repeats,
        "hot_path": ran,  # pd-router rows: what each said it runs (native.py)
        "warm_s": warm_s, "window_s": window_s, "concurrency": list(CONCURRENCY),
        "streaming": args.streaming, "loadgen": loadgen,
        "max_tokens": args.max_tokens, "tpot_ms": args.tpot_ms, "engines": args.engines,
        "runtime_s": time.monotonic() - began,
        "foreign_pct": pooled([r["foreign_pct"] for reps in runs.values() for r in reps]),
        "core_busy_c64": {m: pooled([r.get(m) for (key, c), reps in runs.items() if c == 64
                                     and base_key(key) != "direct" for r in reps])
                          for m in ("load_core_pct", "router_pct")},
    }
    target_info = [{"key": t.key, "label": t.label, "broken": t.broken, "stream": t.stream}
                   for t in targets]
    raw = {"meta": meta, "targets": target_info, "summary": summary,
           "runs": {f"{k}@{c}": v for (k, c), v in runs.items()}}
    (run_dir / "results.json").write_text(json.dumps(raw, indent=1))
    for name, tail in router_logs.items():
        if any(w in tail for w in ("Traceback", "ERROR", "error", "WARNING")):
            print(f"--- {name} log tail (has warnings/errors) ---\n{tail}", flush=True)

    meta["runtime_s"] = time.monotonic() - began
    publish(run_dir / "results.json", meta, target_info, summary, can_plot, docs=not args.no_docs)
    print_checks(summary)
    noise = meta.get("foreign_pct")
    if noise and noise["median"] > 10:
        print(f"WARNING: core {ROUTER_CPU} was {noise['median']:.0f}% busy with other processes "
              "(median over the windows): these numbers are unreliable; rerun on a quiet machine",
              flush=True)
    print(f"done in {(time.monotonic() - began) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
