"""Conversation pins shared between pd-router replicas through a real redis-server
(`sessions.redis_url`, routers/session_store.py); skipped where redis-server is not installed.

The first tests need no Redis: SessionSharing over an in-memory store (adoption rules, failures).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re

import pytest
import requests

from pd_plugins.routers.config import SessionSpec
from pd_plugins.routers.policy import PRESETS
from pd_plugins.routers.policy.base import RequestInfo
from pd_plugins.routers.policy.prefix_index import PrefixIndex
from pd_plugins.routers.session_store import RedisSessionStore, SessionSharing
from pd_plugins.routers.sessions import Session, SessionTable
from pd_plugins.testing.engine_harness import start_all
from pd_plugins.testing.kv_servers import REDIS_SERVER, RedisServer
from pd_plugins.testing.router_harness import RouterProcess
from tests.router.conftest import FAST_HEALTH, LONG_PROMPT, mocks, wait_until

needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed "
                                 "(apt-get install redis-server): Redis session tests skipped")


# -- SessionSharing without Redis ---------------------------------------------------------------
class MemoryStore:
    url = "memory://"

    def __init__(self) -> None:
        self.data: dict[str, Session] = {}
        self.down = False
        self.calls = 0

    async def load(self, session_id):
        self.calls += 1
        if self.down:
            raise ConnectionError("refused")
        return self.data.get(session_id)

    async def save(self, session_id, session, ttl_s):
        self.calls += 1
        if self.down:
            raise ConnectionError("refused")
        self.data[session_id] = session

    async def ping(self):
        if self.down:
            raise ConnectionError("refused")

    async def aclose(self):
        pass


def info(session_id=None, keys=(1, 2, 3, 4), tokens=64) -> RequestInfo:
    return RequestInfo(session_id=session_id, block_keys=list(keys), prompt_tokens=tokens)


def test_sharing_adopts_only_newer_sessions_and_keeps_auto_ids_local():
    async def run():
        clock = [0.0]
        table = SessionTable(SessionSpec(), clock=lambda: clock[0])
        store, index = MemoryStore(), PrefixIndex()
        sharing = SessionSharing(table, store, SessionSpec(), index, block_size=16,
                                 clock=lambda: clock[0])
        # Another replica served two turns of "c1" on decode B (32 tokens resident).
        store.data["c1"] = Session("http://b", turns=2, resident_tokens=32)
        request = info("c1")
        await sharing.pull(request)
        table.resolve(request)
        assert (request.turn, request.pinned_decode, request.resident_tokens) == (2, "http://b", 32)
        assert index.matched_blocks("http://b", [1, 2, 3, 4]) == 2  # its previous prompt
        assert table.counts["store_adopted"] == 1
        # This router serves turn 3: pushed in the background.
        table.record(request, "http://b")
        sharing.push("c1")
        await asyncio.sleep(0)
        await asyncio.gather(*sharing._saves)
        assert store.data["c1"].turns == 3
        # An older copy in Redis (a save that lost a race) does not replace the local entry.
        store.data["c1"] = Session("http://a", turns=1, resident_tokens=16)
        await sharing.pull(info("c1"))
        assert table.get("c1").decode_url == "http://b" and table.counts["store_adopted"] == 1
        # A session found by prefix detection stays local.
        auto = info(None, keys=(7, 8))
        table.resolve(auto)
        auto_id = table.record(auto, "http://a")
        assert auto_id.startswith("auto-")
        sharing.push(auto_id)
        assert not sharing._saves and auto_id not in store.data
        await sharing.aclose()
    asyncio.run(run())


def test_sharing_survives_a_dead_store(caplog):
    async def run():
        clock = [100.0]
        table = SessionTable(SessionSpec(), clock=lambda: clock[0])
        store = MemoryStore()
        store.down = True
        sharing = SessionSharing(table, store, SessionSpec(), retry_after_s=2.0,
                                 clock=lambda: clock[0])
        with caplog.at_level(logging.WARNING, logger="pd_router.sessions"):
            await sharing.start()
            request = info("c1")
            await sharing.pull(request)  # within the back-off: not even tried
            table.resolve(request)
            assert request.turn == 0
            assert table.counts["store_error"] == 1 and store.calls == 0
            clock[0] += 3  # past the back-off: tried again, fails again, not logged again
            await sharing.pull(info("c1"))
            assert table.counts["store_error"] == 2 and store.calls == 1
        assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1
        # Back up: the next push reaches it.
        store.down, clock[0] = False, clock[0] + 3
        table.record(info("c1"), "http://a")
        sharing.push("c1")
        await asyncio.gather(*sharing._saves)
        assert store.data["c1"].decode_url == "http://a"
        await sharing.aclose()
    asyncio.run(run())


@pytest.fixture
def redis_server():
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server): "
                    "Redis session tests skipped")
    pytest.importorskip("redis", reason="redis-py is not installed (pip install 'pd-plugins[redis]')")
    server = RedisServer()
    try:
        server.start().wait_healthy()
        yield server
    finally:
        server.stop(grace=5)


def test_store_round_trip_with_ttl(redis_server):
    async def run():
        store = RedisSessionStore(redis_server.redis_url, prefix="test:")
        try:
            assert await store.load("conv-1") is None
            await store.save("conv-1", Session("http://decode-1", turns=3, resident_tokens=120), 90.5)
            loaded = await store.load("conv-1")
            assert (loaded.decode_url, loaded.turns, loaded.resident_tokens) == ("http://decode-1", 3, 120)
        finally:
            await store.aclose()
    asyncio.run(run())
    client = redis_server.client()
    assert 85 <= client.ttl("test:conv-1") <= 91  # EXPIRE = ttl_s (rounded up to whole seconds)
    assert client.exists("conv-1") == 0           # every key carries the prefix
    client.close()


def _route(resp: requests.Response) -> tuple[str, str, int]:
    """(decode url, session id, turn) from x-pd-route."""
    header = resp.headers["x-pd-route"]
    decode = re.search(r"decode=([^,]+),", header).group(1)
    match = re.search(r"session=([^,]+), turn=(\d+)", header)
    assert match, header
    return decode, match.group(1), int(match.group(2))


def _turn(router, session: str, prompt: str):
    return requests.post(router.url + "/v1/completions", headers={"x-session-id": session},
                         json={"model": "mock", "prompt": prompt, "max_tokens": 4}, timeout=30)


def _store_errors(router) -> float:
    match = re.search(r'^pd_router_session_events_total\{event="store_error"\} (\S+)$',
                      router.metrics(), re.M)
    assert match, "no store_error counter on /metrics"
    return float(match.group(1))


# The multi_turn preset without its TTFT-SLO admission, and health checks that tolerate a busy
# machine: on a loaded 2-core box, 429s and workers marked down are not what these tests are about.
POLICY = {**copy.deepcopy(PRESETS["multi_turn"]), "admission": None}
HEALTH = {**FAST_HEALTH, "interval_s": 1.0, "timeout_s": 10, "failure_threshold": 5}


def _routers(prefills, decodes, redis_url, count=2):
    """Router B lists the decode workers in the opposite order: between idle workers each router
    takes its first, so B follows a pin only because Redis told it."""
    sessions = {"redis_url": redis_url, "redis_prefix": "it:", "redis_timeout_s": 0.5}
    return [RouterProcess(f"router-{name}", prefill=[p.worker_arg() for p in prefills],
                          decode=[d.worker_arg() for d in decodes[::step]], args=("--log-format", "text"),
                          config={"health": HEALTH, "policy": POLICY, "sessions": sessions,
                                  "route_header": "full"})
            for name, step in zip("ab"[:count], (1, -1))]


@needs_redis
def test_two_routers_agree_on_pins(redis_server):
    prefills, decodes = mocks(prefills=1, decodes=2)
    routers = _routers(prefills, decodes, redis_server.redis_url)
    client = redis_server.client()
    try:
        start_all([*prefills, *decodes], timeout=60)
        start_all(routers, timeout=60)
        a, b = routers
        # Control: left to itself, B puts a new conversation on the other decode worker than A.
        control = [_route(_turn(r, f"control-{r.name}", f"control {r.name}: " + LONG_PROMPT))[0]
                   for r in routers]
        assert control[0] != control[1], control
        for n in range(6):
            session, prompt = f"conv-{n}", f"conversation {n}: " + LONG_PROMPT
            one = _turn(a, session, prompt)
            assert one.status_code == 200, one.text
            decode, sid, turn = _route(one)
            assert (sid, turn) == (session, 1)
            wait_until(lambda: client.exists(f"it:{session}"), 10, "the pin in Redis")  # async save
            # Turn 2 through the other router: same decode worker, and it knows the turn.
            prompt += one.json()["choices"][0]["text"] + " and then? " + LONG_PROMPT[:80]
            two = _turn(b, session, prompt)
            assert two.status_code == 200, two.text
            assert _route(two) == (decode, session, 2), two.headers["x-pd-route"]
            # ... where its history is cached: append-prefill runs the new tokens there (it does
            # so only for a later turn on the pinned worker).
            assert two.headers["x-pd-route"].startswith("prefill=local,"), two.headers["x-pd-route"]
            wait_until(lambda: b"\"turns\":2" in (client.get(f"it:{session}") or b""), 10, "turn 2 saved")
            # Turn 3 back through the first router, which adopts router B's newer copy.
            prompt += two.json()["choices"][0]["text"] + " more? " + LONG_PROMPT[:40]
            three = _turn(a, session, prompt)
            assert three.status_code == 200, three.text
            assert _route(three) == (decode, session, 3), three.headers["x-pd-route"]
        metrics_b = b.metrics()
        assert re.search(r'event="store_adopted"\} 6\.0', metrics_b), metrics_b
        assert _store_errors(a) == 0 and _store_errors(b) == 0
        assert 0 < client.ttl("it:conv-0") <= 3600
    finally:
        client.close()
        for proc in [*routers, *prefills, *decodes]:
            proc.stop(grace=5)


@needs_redis
def test_serving_survives_redis_going_away(redis_server):
    prefills, decodes = mocks(prefills=1, decodes=2)
    (router,) = _routers(prefills, decodes, redis_server.redis_url, count=1)
    try:
        start_all([*prefills, *decodes], timeout=60)
        start_all([router], timeout=60)
        first = _turn(router, "before", "before the outage: " + LONG_PROMPT)
        assert first.status_code == 200 and _store_errors(router) == 0
        redis_server.stop(grace=5)
        for n in range(8):  # named sessions, each turn twice: the local table still pins
            prompt = f"outage {n}: " + LONG_PROMPT
            one = _turn(router, f"down-{n}", prompt)
            assert one.status_code == 200, (one.text, requests.get(router.url + "/ready").text,
                                            router.log_tail())
            two = _turn(router, f"down-{n}", prompt + one.json()["choices"][0]["text"] + " next")
            assert two.status_code == 200, two.text
            assert _route(two)[::2] == (_route(one)[0], 2), (one.headers, two.headers)
        assert _store_errors(router) >= 1
        # Redis back on the same port: within the 2 s back-off the pins flow again.
        redis_server.start().wait_healthy()
        client = redis_server.client()
        try:
            def saved() -> bool:
                resp = _turn(router, "after", "after the outage: " + LONG_PROMPT)
                assert resp.status_code == 200, resp.text
                return bool(client.exists("it:after"))
            wait_until(saved, 15, "a pin saved after Redis came back")
        finally:
            client.close()
    finally:
        for proc in [router, *prefills, *decodes]:
            proc.stop(grace=5)
