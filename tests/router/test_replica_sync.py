"""ReplicaSync (routers/replica_sync.py) between two in-process replicas over a real redis-server:
pins, loads, prefixes and latency samples cross within the stated bound, a replica that starts late catches up,
and an outage leaves local state in charge, then sharing resumes. Skipped where redis-server is
not installed. Two pd-router processes sharing one Redis: tests/router/test_session_store.py."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from pd_plugins.routers.config import SessionSpec, WorkerSpec
from pd_plugins.routers.policy.base import RequestInfo
from pd_plugins.routers.policy.latency_model import LatencyModels
from pd_plugins.routers.policy.prefix_index import PrefixIndex
from pd_plugins.routers.replica_channels import (
    LatencyChannel, LoadChannel, PinChannel, PrefixChannel, ReplicaShare,
)
from pd_plugins.routers.replica_sync import MAX_ENTRY_BYTES, READ_COUNT, RedisLog, ReplicaSync
from pd_plugins.routers.sessions import SessionTable
from pd_plugins.routers.workers import WorkerPool
from pd_plugins.testing.kv_servers import REDIS_SERVER, RedisServer

INTERVAL_S = 0.05
BOUND_S = 0.5  # what a change may take to reach the other replica here (stated: ~interval + RTT)


@pytest.fixture
def redis_server():
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server): "
                    "replica sync tests skipped")
    pytest.importorskip("redis", reason="redis-py is not installed (pip install 'pd-plugins[redis]')")
    server = RedisServer()
    try:
        server.start().wait_healthy()
        yield server
    finally:
        server.stop(grace=5)


class Replica:
    """One router's shared state: a session table, a prefix index, a worker pool, and its sync."""

    def __init__(self, redis_url: str, name: str) -> None:
        self.table, self.index, self.pool = SessionTable(SessionSpec()), PrefixIndex(), WorkerPool()
        for url in ("http://d1", "http://d2"):
            self.pool.add(WorkerSpec(url), "decode")
        self.sync = ReplicaSync(RedisLog(redis_url, "test:sync", timeout_s=0.25, stream_len=1000,
                                         ttl_s=60), replica_id=name, interval_s=INTERVAL_S,
                                retry_after_s=0.5)
        self.pins = self.sync.add(PinChannel(self.table, name))
        self.loads = self.sync.add(LoadChannel(lambda: self.pool, ttl_s=1.0))
        self.share = ReplicaShare(self.pins, self.sync.add(PrefixChannel(self.index)))
        self.latency = LatencyModels()
        self.sync.add(LatencyChannel(self.latency))

    def serve(self, keys, decode: str, session_id=None) -> RequestInfo:
        """What the proxy does around a turn: resolve, record, share."""
        info = RequestInfo(session_id=session_id, block_keys=list(keys), prompt_tokens=16 * len(keys))
        self.table.resolve(info)
        sid = self.table.record(info, decode)
        self.index.record_routed(decode, info.block_keys)
        self.share.served(sid, info, decode, None)
        return info

    def decode(self, url: str):
        return self.pool.get(url, "decode")


@contextlib.asynccontextmanager
async def two_replicas(redis_url: str):
    """Replicas "ra" and "rb", both syncing (Redis answered each), closed on the way out."""
    a, b = Replica(redis_url, "ra"), Replica(redis_url, "rb")
    await a.sync.start()
    await b.sync.start()
    try:
        await until(lambda: a.sync.up and b.sync.up, 5, "both syncs up")
        yield a, b
    finally:
        await a.sync.aclose()
        await b.sync.aclose()


async def until(predicate, timeout_s: float, what: str) -> float:
    """Seconds until predicate() holds (fails past timeout_s)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.005)
    return time.monotonic() - start


def test_pins_loads_and_prefixes_cross_within_the_bound(redis_server):
    async def run():
        async with two_replicas(redis_server.redis_url) as (a, b):
            # A conversation without a session id on A ...
            first = a.serve([1, 2, 3], "http://d2")
            took = await until(lambda: b.table.get(first.session_id) is not None, BOUND_S, "the pin on B")
            # ... its next turn on B is detected and pinned where A put it.
            second = RequestInfo(block_keys=[1, 2, 3, 4], prompt_tokens=64)
            b.table.resolve(second)
            assert (second.session_id, second.pinned_decode, second.turn) == (first.session_id, "http://d2", 1)
            # The prefix A routed steers B's index.
            assert b.index.matched_blocks("http://d2", [1, 2, 3, 9]) == 3
            # A's in-flight load shows on B's worker, and goes when A's requests end.
            a.decode("http://d1").in_flight += 4
            took_load = await until(lambda: b.decode("http://d1").in_flight == 4, BOUND_S, "A's load on B")
            assert a.decode("http://d1").in_flight == 4  # B has none of its own to add
            a.decode("http://d1").in_flight -= 4
            await until(lambda: b.decode("http://d1").in_flight == 0, BOUND_S, "A's load gone on B")
            # The prefill legs A measured reach B's latency fit.
            for tokens in range(1_000, 9_000, 1_000):
                a.latency.prefill.observe(tokens, 0.01 + 2e-5 * tokens)
            took_fit = await until(lambda: b.latency.prefill.n == 8, BOUND_S, "A's samples in B's fit")
            assert b.latency.prefill.coefficients == a.latency.prefill.coefficients
            assert max(took, took_load, took_fit) < BOUND_S
            # A replica that starts now catches up on the pins and the fit from the stream's window.
            c = Replica(redis_server.redis_url, "rc")
            await c.sync.start()
            try:
                await until(lambda: c.table.get(first.session_id) is not None, 5, "C catching up")
                await until(lambda: c.latency.prefill.n == 8, 5, "C's fit catching up")
            finally:
                await c.sync.aclose()
    asyncio.run(run())


def test_outage_leaves_local_state_and_sharing_resumes(redis_server):
    async def run():
        async with two_replicas(redis_server.redis_url) as (a, b):
            a.decode("http://d1").in_flight += 2
            await until(lambda: b.decode("http://d1").in_flight == 2, BOUND_S, "A's load on B")
            redis_server.stop(grace=5)
            # Local work goes on without waiting: serving touches only local tables. The best of
            # three turns under 10 ms (a pause of this busy machine is in one, a wait on Redis
            # would be in each), and none as long as the Redis client's timeout (a wait the
            # first turn alone made, a reconnection, would show there).
            took, turns = [], []
            for n in range(3):
                started = time.monotonic()
                turns.append(a.serve([5, 6, 7 + n], "http://d1", f"during-{n}"))
                took.append(time.monotonic() - started)
            assert min(took) < 0.01 and max(took) < 0.2, took
            during = turns[0]
            await until(lambda: a.sync.counts["error"] >= 1 and b.sync.counts["error"] >= 1, 5, "errors counted")
            assert not a.sync.up
            # A's load on B expires (ttl 1 s): B routes from its own counts.
            await until(lambda: b.decode("http://d1").in_flight == 0, 3, "A's stale load dropped on B")
            redis_server.start().wait_healthy()
            # The pin made during the outage was kept and reaches B once Redis is back.
            await until(lambda: b.table.get(during.session_id) is not None, 10, "the outage's pin on B")
            await until(lambda: b.decode("http://d1").in_flight == 2, 5, "A's load on B again")
            assert a.sync.up and b.sync.up
    asyncio.run(run())


def test_one_read_takes_a_bounded_number_of_entries(redis_server):
    # 200 entries of up to MAX_ENTRY_BYTES each: one XREAD reply could hold 1.6 GB
    assert READ_COUNT * MAX_ENTRY_BYTES <= 32 << 20

    async def run():
        log = RedisLog(redis_server.redis_url, "test:count", timeout_s=1.0, stream_len=1000, ttl_s=60)
        try:
            for n in range(3 * READ_COUNT):
                await log.append(bytes([n]))
            first = await log.read("0-0", 1)
            assert [payload for _, payload in first] == [bytes([n]) for n in range(READ_COUNT)]
            assert len(await log.read(first[-1][0], 1)) == READ_COUNT  # the rest on the next reads
        finally:
            await log.aclose()
    asyncio.run(run())
