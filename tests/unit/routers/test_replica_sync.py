"""ReplicaSync's own rules (routers/replica_sync.py) over an in-memory stand-in for the Redis
stream (MemoryLog, named as such: the real-Redis tests are in tests/router/test_replica_sync.py):
a starting replica skips history older than the session TTL, and a failing channel never stops
the publisher."""

from __future__ import annotations

import asyncio

from pd_plugins.routers.config import SessionSpec
from pd_plugins.routers.replica_channels import PinChannel
from pd_plugins.routers.replica_sync import ReplicaSync, _encode, _Entry
from pd_plugins.routers.sessions import Session, SessionTable


class MemoryLog:
    """A Redis stream in memory: ids are "<ms>-<seq>" from a clock the test sets."""

    timeout_s, url = 0.2, "memory://"

    def __init__(self) -> None:
        self.entries: list[tuple[str, bytes]] = []
        self.ms = 1_000_000

    def add(self, origin: str, channels: dict[str, list], age_s: float = 0.0) -> None:
        entry_id = f"{self.ms - int(age_s * 1000)}-{len(self.entries)}"
        self.entries.append((entry_id, _encode(_Entry(origin, channels))))
        self.entries.sort(key=lambda e: tuple(int(p) for p in e[0].split("-")))

    async def append(self, payload: bytes) -> None:
        self.entries.append((f"{self.ms}-{len(self.entries)}", payload))

    async def last_id(self) -> str:
        return self.entries[-1][0] if self.entries else "0-0"

    async def read(self, after: str, block_ms: int, count: int = 200):
        key = tuple(int(p) for p in after.split("-"))
        newer = [e for e in self.entries if tuple(int(p) for p in e[0].split("-")) > key]
        if not newer:
            await asyncio.sleep(block_ms / 1000)
        return newer[:count]

    async def aclose(self) -> None:
        pass


async def until(sync: ReplicaSync, done, tries: int = 200) -> None:
    """Wait for done() (at most `tries` x 10 ms); no background task of `sync` may have died."""
    for _ in range(tries):
        if done():
            break
        await asyncio.sleep(0.01)
    assert all(not t.done() for t in sync._tasks), "a background task died"


def pin(session_id: str, decode: str, turns: int = 2) -> list:
    return [session_id, decode, turns, 64, None, False]


def test_a_starting_replica_skips_pins_older_than_the_session_ttl():
    async def run():
        log = MemoryLog()
        log.add("old-replica", {"pins:": [pin("expired", "http://d1")]}, age_s=120)
        log.add("old-replica", {"pins:": [pin("recent", "http://d2")]}, age_s=30)
        table = SessionTable(SessionSpec(ttl_s=60))
        sync = ReplicaSync(log, replica_id="new", interval_s=0.01, history_s=60)
        sync.add(PinChannel(table, "new"))
        await sync.start()
        try:
            for _ in range(100):
                if sync.counts["applied"] + sync.counts["expired"] >= 2:
                    break
                await asyncio.sleep(0.01)
        finally:
            await sync.aclose()
        return table, sync

    table, sync = asyncio.run(run())
    assert table.get("recent") is not None and table.get("recent").decode_url == "http://d2"
    assert table.get("expired") is None
    assert sync.counts["expired"] == 1


def test_a_channel_that_raises_in_tick_does_not_stop_the_publisher():
    class Broken:
        name, live_only = "broken", False

        def take(self, now):
            return None

        def put_back(self, items):
            pass

        def apply(self, origin, items, now):
            pass

        def tick(self, now):
            raise RuntimeError("a bug in a channel")

    async def run():
        log = MemoryLog()
        table = SessionTable(SessionSpec())
        sync = ReplicaSync(log, replica_id="r1", interval_s=0.01)
        sync.add(Broken())
        pins = sync.add(PinChannel(table, "r1"))
        await sync.start()
        try:
            await asyncio.sleep(0.05)  # the broken tick has run several times by now
            table.adopt("s1", Session("http://d1", 1, 16))
            pins.recorded("s1")
            await until(sync, lambda: log.entries)
        finally:
            await sync.aclose()
        return log, sync

    log, sync = asyncio.run(run())
    assert len(log.entries) == 1, "the publisher stopped after the channel's error"
    assert sync.counts["error"] >= 1


def test_hostile_peer_entries_are_counted_unreadable_and_the_reader_goes_on():
    """Another replica's entries are peer input: an infinite number where an int goes, a session
    id no client could send (each pin refused alone), nesting past msgpack's recursion, an entry
    past MAX_ENTRY_BYTES (each entry unreadable). Each is counted and skipped; the reader lives
    on and adopts the good pin after them."""
    from pd_plugins.routers import replica_sync

    async def run():
        log = MemoryLog()
        log.add("peer", {"pins:": [["s-inf", "http://d", float("inf"), 1, None, False]]})
        log.add("peer", {"pins:": [pin("x" * 10_000, "http://d")]})
        nested = b"\x91" * 200_000 + b"\xc0"  # msgpack: a list in a list ... 200,000 deep
        log.entries.append((f"{log.ms}-{len(log.entries)}", nested))
        too_big = b"\x00" * (replica_sync.MAX_ENTRY_BYTES + 1)
        log.entries.append((f"{log.ms}-{len(log.entries)}", too_big))
        log.ms += 1
        log.add("peer", {"pins:": [pin("good", "http://d2")]})
        table = SessionTable(SessionSpec())
        sync = ReplicaSync(log, replica_id="me", interval_s=0.01)
        sync.add(PinChannel(table, "me"))
        await sync.start()
        try:
            await until(sync, lambda: table.get("good") is not None)
        finally:
            await sync.aclose()
        return table, sync

    table, sync = asyncio.run(run())
    assert table.get("good") is not None and table.get("s-inf") is None
    assert sync.counts["unreadable"] == 2  # the nesting, the size
    assert table.counts["replica_refused"] == 2  # the inf, the id: that pin alone, the others go on


class SwallowingLog(MemoryLog):
    """A stream client that swallows every cancel of a blocking read, as redis-py's blocking
    commands have been seen to (redis-py #2028, #2551): the read just returns nothing."""

    swallowed = 0

    async def read(self, after: str, block_ms: int, count: int = 200):
        try:
            return await super().read(after, block_ms, count)
        except asyncio.CancelledError:
            SwallowingLog.swallowed += 1
            return []


def test_aclose_stops_a_reader_whose_client_swallows_the_cancel():
    """A CI run hung for good in asyncio.run's final cancel of a reader that lived on after
    aclose(): the loops end on aclose() whatever the client does with the cancel."""
    async def run():
        sync = ReplicaSync(SwallowingLog(), replica_id="me", interval_s=0.05)
        await sync.start()
        await asyncio.sleep(0.05)  # the reader is in its blocking read (100 ms)
        await sync.aclose()
        return sync

    sync = asyncio.run(asyncio.wait_for(run(), 10))
    assert SwallowingLog.swallowed >= 1  # the client did swallow it ...
    assert all(task.done() for task in sync._tasks)  # ... and the reader stopped all the same
