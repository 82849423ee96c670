"""Two real pd-router processes in front of pd-mock-engine processes, sharing one real
redis-server (`sessions.redis_url`, routers/replica_sync.py): they agree on conversation pins
(named and auto-detected), on prefixes one of them learned, and on the load of the workers; when
Redis is killed, requests go on without waiting, and sharing resumes when it is back. Skipped where
redis-server is not installed. The sync itself, in process: tests/router/test_replica_sync.py.

Router B lists the workers in the opposite order: between idle workers each router takes its
first, so B follows A's choice only because Redis told it (each test checks that control).
Prompts are token ids: their block keys are the same in every process (text prompts without a
tokenizer are hashed per process).
"""

from __future__ import annotations

import copy
import re
import threading
import time
from typing import Callable

import pytest
import requests

from pd_plugins.routers.policy import PRESETS
from pd_plugins.testing.engine_harness import start_all
from pd_plugins.testing.kv_servers import REDIS_SERVER
from pd_plugins.testing.router_harness import RouterProcess
from tests.router.conftest import FAST_HEALTH, mocks, wait_until
from tests.router.test_replica_sync import redis_server  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed "
                                "(apt-get install redis-server): replica tests skipped")

# The multi_turn preset without its TTFT-SLO admission, and health checks that tolerate a busy
# machine: on a loaded 2-core box, 429s and workers marked down are not what these tests are about.
MULTI_TURN = {**copy.deepcopy(PRESETS["multi_turn"]), "admission": None}
HEALTH = {**FAST_HEALTH, "interval_s": 1.0, "timeout_s": 10, "failure_threshold": 5}
LOAD_BOUND_S = 0.5  # A's in-flight count shows on B within this (50 ms batches + Redis + polling)


def _routers(prefills, decodes, redis_url, policy=MULTI_TURN):
    sessions = {"redis_url": redis_url, "redis_prefix": "it:", "redis_timeout_s": 0.5}
    return [RouterProcess(f"router-{name}", prefill=[p.worker_arg() for p in prefills[::step]],
                          decode=[d.worker_arg() for d in decodes[::step]], args=("--log-format", "text"),
                          config={"health": HEALTH, "policy": policy, "sessions": sessions,
                                  "route_header": "full"})
            for name, step in (("a", 1), ("b", -1))]


def _route(resp: requests.Response) -> dict:
    header = resp.headers["x-pd-route"]
    out = {"prefill": re.search(r"prefill=([^,]+),", header).group(1),
           "decode": re.search(r"decode=([^,]+),", header).group(1)}
    match = re.search(r"session=([^,]+), turn=(\d+)", header)
    if match:
        out["session"], out["turn"] = match.group(1), int(match.group(2))
    return out


def _post(router, prompt: list[int], session: str | None = None, max_tokens: int = 4, stream=False):
    headers = {"x-session-id": session} if session else {}
    resp = requests.post(router.url + "/v1/completions", headers=headers, stream=stream, timeout=30,
                         json={"model": "mock", "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
    assert resp.status_code == 200, resp.text
    return resp


def _counter(router, name: str, event: str) -> float:
    match = re.search(rf'^{name}\{{event="{event}"\}} (\S+)$', router.metrics(), re.M)
    return float(match.group(1)) if match else 0.0


def _resting(read: Callable[[], float], quiet_s: float = 1.0, timeout_s: float = 20.0) -> float:
    """`read()` once it has not changed for `quiet_s`."""
    value, since, deadline = read(), time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"still changing after {timeout_s} s"
        time.sleep(0.1)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


def _gauge(router, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", router.metrics(), re.M)
    return float(match.group(1)) if match else -1.0


def _started(procs):
    start_all([p for p in procs if "router" not in p.name], timeout=60)
    start_all([p for p in procs if "router" in p.name], timeout=60)
    a, b = (p for p in procs if "router" in p.name)
    wait_until(lambda: _gauge(a, "pd_router_replica_sync_up") == 1 and _gauge(b, "pd_router_replica_sync_up") == 1,
               15, "both replicas syncing")
    return a, b


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


@pytest.mark.parametrize("named", [True, False], ids=["named", "auto-detected"])
def test_alternating_turns_stay_on_the_pinned_decode(redis_server, named):  # noqa: F811
    prefills, decodes = mocks(prefills=1, decodes=2)
    routers = _routers(prefills, decodes, redis_server.redis_url)
    procs = [*prefills, *decodes, *routers]
    try:
        a, b = _started(procs)
        # Control: left to itself, B puts a new conversation on the other decode worker than A.
        control = [_route(_post(r, _tokens(100 + i, 96)))["decode"] for i, r in enumerate(routers)]
        assert control[0] != control[1], control
        for n in range(4):
            prompt = _tokens(n, 96)
            session = f"conv-{n}" if named else None
            pinned, sid = None, None
            for turn in range(1, 5):  # turns alternate: A, B, A, B
                router = routers[(turn - 1) % 2]
                route = _route(_post(router, prompt, session))
                if turn == 1:
                    pinned = route["decode"]
                    if not named:  # the first turn of an unnamed conversation has no session yet
                        assert "session" not in route or route["session"].startswith("auto-")
                else:
                    assert route["decode"] == pinned, (turn, route)
                    assert route["turn"] == turn, (turn, route)
                    sid = sid or route["session"]
                    assert route["session"] == sid
                    assert named or sid.startswith("auto-")
                    # the pinned decode holds the history: the new turn is appended there
                    assert route["prefill"] == "local", route
                prompt = prompt + _tokens(1000 + 10 * n + turn, 40)
                time.sleep(0.3)  # a user's think time; the pin crosses in ~50-100 ms
        assert _counter(b, "pd_router_session_events_total", "replica_adopted") >= 4
        assert _counter(a, "pd_router_replica_sync_events_total", "error") == 0
    finally:
        for proc in reversed(procs):
            proc.stop(grace=5)


def test_a_prefix_learned_by_a_steers_b(redis_server):  # noqa: F811
    prefills, decodes = mocks(prefills=2, decodes=1)
    routers = _routers(prefills, decodes, redis_server.redis_url, policy="prefix_cache")
    procs = [*prefills, *decodes, *routers]
    try:
        a, b = _started(procs)
        control = [_route(_post(r, _tokens(200 + i, 160)))["prefill"] for i, r in enumerate(routers)]
        assert control[0] != control[1], control
        shared = _tokens(7, 160)
        learned = _route(_post(a, shared))["prefill"]
        time.sleep(0.3)
        # Same 160-token prefix, new tail, through B: the prefill A cached it on.
        assert _route(_post(b, shared + _tokens(8, 48)))["prefill"] == learned
    finally:
        for proc in reversed(procs):
            proc.stop(grace=5)


def test_the_load_of_a_reaches_b_within_the_bound(redis_server):  # noqa: F811
    prefills, decodes = mocks(prefills=1, decodes=2, decode_args=("--tpot-ms", "50"))
    routers = _routers(prefills, decodes, redis_server.redis_url, policy="least_loaded")
    procs = [*prefills, *decodes, *routers]
    try:
        a, b = _started(procs)
        gauge = re.compile(r'^pd_router_worker_in_flight\{role="decode",url="([^"]+)"\} (\S+)$', re.M)

        def b_in_flight() -> dict[str, float]:
            return {url: float(v) for url, v in gauge.findall(b.metrics())}

        assert sum(b_in_flight().values()) == 0
        resp = _post(a, _tokens(3, 32), max_tokens=60, stream=True)  # ~3 s of tokens
        sent = time.monotonic()
        decode = _route(resp)["decode"]
        reader = threading.Thread(target=lambda: resp.content and None)
        reader.start()
        wait_until(lambda: b_in_flight().get(decode) == 1, 5, "A's request on B's view")
        took = time.monotonic() - sent
        assert took < LOAD_BOUND_S, f"A's load took {took:.3f} s to reach B"
        # B, choosing by load, now sends its own request to the other decode worker.
        assert _route(_post(b, _tokens(4, 32)))["decode"] != decode
        reader.join(30)
        resp.close()
        wait_until(lambda: b_in_flight().get(decode) == 0, 5, "A's request gone from B's view")
    finally:
        for proc in reversed(procs):
            proc.stop(grace=5)


def test_redis_killed_mid_run_requests_never_wait(redis_server):  # noqa: F811
    prefills, decodes = mocks(prefills=1, decodes=2)
    routers = _routers(prefills, decodes, redis_server.redis_url)
    procs = [*prefills, *decodes, *routers]
    try:
        a, b = _started(procs)
        latencies: dict[str, list[float]] = {"before": [], "outage": []}

        def serve(phase: str, count: int, offset: int) -> None:
            for n in range(count):
                prompt = _tokens(offset + n, 96)
                for turn, router in enumerate(routers):  # each conversation: A then B
                    started = time.monotonic()
                    _post(router, prompt)
                    latencies[phase].append(time.monotonic() - started)
                    prompt = prompt + _tokens(offset + n + 5000, 32)

        serve("before", 6, 0)
        redis_server.proc.kill()  # SIGKILL: connections die mid-flight
        redis_server.proc.wait(10)
        serve("outage", 15, 100)
        assert _counter(a, "pd_router_replica_sync_events_total", "error") >= 1
        assert _gauge(a, "pd_router_replica_sync_up") == 0
        # No request waited on Redis: the slowest in the outage is about as fast as before it
        # (one Redis command's timeout is 0.5 s here, the old per-request read would show it).
        slowest, typical = max(latencies["outage"]), sorted(latencies["before"])[len(latencies["before"]) // 2]
        assert slowest < max(0.4, 4 * typical), (slowest, typical, latencies)
        # Redis back on the same port: sharing resumes (within the 1 s retry).
        redis_server.start().wait_healthy()
        wait_until(lambda: _gauge(a, "pd_router_replica_sync_up") == 1 and _gauge(b, "pd_router_replica_sync_up") == 1,
                   15, "both replicas syncing again")
        # What the replicas queued during the outage reaches the other first (B adopting A's pins
        # of then): the adoption awaited below must be of the pin made after it, so it waits for
        # B's count to rest (no adoption for 1 s) first.
        adopted = _resting(lambda: _counter(b, "pd_router_session_events_total", "replica_adopted"))
        prompt = _tokens(999, 96)
        first = _route(_post(a, prompt, "after"))
        wait_until(lambda: _counter(b, "pd_router_session_events_total", "replica_adopted") > adopted,
                   5, "B adopting A's pin after the outage")
        assert _route(_post(b, prompt + _tokens(998, 32), "after"))["decode"] == first["decode"]
    finally:
        for proc in reversed(procs):
            proc.stop(grace=5)
