"""What router replicas tell each other, through one Redis stream, without a request ever waiting.

Several pd-router replicas behind one load balancer each route from their own state; this module
keeps that state in step. Each kind of state is a channel (routers/replica_channels.py: session
pins, worker loads, learned prefix locations): requests only update and read the local tables,
and a channel remembers what changed. Two background tasks do the rest:

- the publisher, every `interval_s` (50 ms by default), takes each channel's changes and appends
  them as one entry to a Redis stream (XADD, MAXLEN ~ `stream_len`, so Redis keeps a bounded
  window; the key expires when no replica writes for `ttl_s`);
- the reader blocks on XREAD for the entries of the other replicas and hands each channel its
  part. A replica that starts, or comes back after an outage, first reads the stream's window
  (pins and prefixes; loads only from live entries), skipping entries older than `history_s`
  (the session TTL: a pin older than that has expired on the replica that wrote it).

So what one replica learns reaches the others within about `interval_s` plus a Redis round trip.
Redis is never on a request's path: when it fails (refused, timed out: every command is bounded
by `timeout_s`), the sync counts an error (`pd_router_replica_sync_events{event="error"}`, and
`pd_router_replica_sync_up` 0), logs at most once a minute, keeps routing from local state (peer
loads expire after `load_ttl_s`), keeps the changes to publish (bounded), and retries every
`retry_after_s`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from typing import Callable, Protocol

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pd_plugins.routers.config import ConfigError

log = logging.getLogger("pd_router.replicas")
PEER_FORGET_S = 60.0  # a replica not heard from this long is no longer listed


class Channel(Protocol):
    """One kind of shared state."""

    name: str                       # unique among a sync's channels (e.g. "pins:<model>")
    live_only: bool                 # True: ignore the stream's old entries (loads)

    def take(self, now: float) -> list | None:
        """The local changes to publish now, or None (nothing new)."""

    def put_back(self, items: list) -> None:
        """Publishing `items` failed: keep them for the next try (bounded)."""

    def apply(self, origin: str, items: list, now: float) -> None:
        """Another replica's changes."""

    def tick(self, now: float) -> None:
        """Called after every publish round (e.g. expire what peers said too long ago)."""


class _Entry(msgspec.Struct, array_like=True):
    origin: str                     # the replica that wrote it
    channels: dict[str, list]


_encode = msgspec.msgpack.Encoder().encode
# An entry larger than this is neither published nor read (a peer's hostile entry: one of nested
# empty arrays costs about 0.2-0.3 s of decoding per MB). Publishers stay well under it: the
# prefix channel takes a bounded number of keys per entry (replica_channels.py).
MAX_ENTRY_BYTES = 8 << 20
# Entries one XREAD returns: a reply of 200 entries could hold 1.6 GB; this many hold at most
# 32 MiB. A starting replica reads the stream's window in as many round trips (a few ms each).
READ_COUNT = max(1, (32 << 20) // MAX_ENTRY_BYTES)
# Entries larger than this are decoded in a worker thread: the event loop keeps serving.
DECODE_IN_THREAD_BYTES = 256 << 10
_decode = msgspec.msgpack.Decoder(_Entry).decode


class RedisLog:
    """The transport: one Redis stream (redis-py's asyncio client). Errors propagate."""

    FIELD = b"e"

    def __init__(self, url: str, key: str, timeout_s: float, stream_len: int, ttl_s: float,
                 password: str | None = None) -> None:
        self.check_installed()
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.url, self.key, self.stream_len = url, key, stream_len
        self.ttl_ms = max(1000, int(ttl_s * 1000))
        self.timeout_s = timeout_s
        # One retry without backoff: enough to replace a pooled connection that a Redis restart
        # closed, without multiplying the wait when Redis is down. Two clients: the reader's
        # blocking XREAD must not hold up the publisher.
        options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1),
                       password=password)
        self._writer = aioredis.from_url(url, **options)
        self._reader = aioredis.from_url(url, **{**options, "socket_timeout": timeout_s + 1.0})

    @staticmethod
    def check_installed() -> None:
        try:
            import redis.asyncio  # noqa: F401
        except ImportError:
            raise ConfigError("sessions.redis_url needs the redis package (redis-py): "
                              "pip install 'pd-plugins[redis]'") from None

    async def append(self, payload: bytes) -> None:
        async with self._writer.pipeline(transaction=False) as pipe:
            pipe.xadd(self.key, {self.FIELD: payload}, maxlen=self.stream_len, approximate=True)
            pipe.pexpire(self.key, self.ttl_ms)
            await pipe.execute()

    async def last_id(self) -> str:
        """The newest entry's id ("0-0" for an empty or missing stream)."""
        newest = await self._writer.xrevrange(self.key, count=1)
        return newest[0][0].decode() if newest else "0-0"

    async def read(self, after: str, block_ms: int, count: int = READ_COUNT) -> list[tuple[str, bytes]]:
        answer = await self._reader.xread({self.key: after}, count=count, block=block_ms)
        return [(entry_id.decode(), fields.get(self.FIELD, b""))
                for _, entries in answer or () for entry_id, fields in entries]

    async def aclose(self) -> None:
        # bounded: closing a client whose connection died mid-command was seen to wait forever
        closing = [asyncio.create_task(client.aclose()) for client in (self._writer, self._reader)]
        done, pending = await asyncio.wait(closing, timeout=self.timeout_s * 4)
        for task in pending:
            task.cancel()
            log.warning("replica sync: a Redis client did not close within %.1f s; left behind",
                        self.timeout_s * 4)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: closing a dead connection may fail, and that is fine


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class ReplicaSync:
    """This replica's channels kept in step with the other replicas' through a RedisLog."""

    def __init__(self, log_: RedisLog, replica_id: str | None = None, interval_s: float = 0.05,
                 retry_after_s: float = 1.0, log_every_s: float = 60.0,
                 history_s: float = math.inf,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.channels = log_, {}
        self.replica_id = replica_id or uuid.uuid4().hex[:8]
        self.interval_s, self.retry_after_s, self.log_every_s = interval_s, retry_after_s, log_every_s
        self.clock, self.history_s = clock, history_s
        self.timeout_s = log_.timeout_s
        self.counts = {"published": 0, "applied": 0, "error": 0, "unreadable": 0, "expired": 0,
                       "oversized": 0}
        self.up = False
        self.peers: dict[str, float] = {}  # replica id -> when an entry of it was last applied
        self._last_id = "0-0"
        self._live_from: tuple[int, int] | None = None  # entries up to this id are history
        self._logged_at = -math.inf
        self._tasks: list[asyncio.Task] = []
        # Checked by both loops: redis-py's blocking reads have been known to swallow a cancel
        # (redis-py #2028, #2551), and a CI run hung in asyncio.run's final cancel on one.
        self._stopping = False

    def add(self, channel: Channel) -> Channel:
        if channel.name in self.channels:
            raise ConfigError(f"replica sync: two channels named {channel.name!r}")
        self.channels[channel.name] = channel
        return channel

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the background tasks; never waits for Redis longer than a few timeouts."""
        self._tasks = [asyncio.create_task(self._publisher(), name="replica-sync-publish"),
                       asyncio.create_task(self._reader(), name="replica-sync-read")]

    async def aclose(self) -> None:
        """Stop the loops and close the log, each wait bounded: shutdown never hangs on Redis
        (a CI run once hung here, in the outage test, with no wait left unbounded but these)."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=self.timeout_s * 4)
            for task in pending:
                log.warning("replica sync: task %s did not stop within %.1f s of its cancel",
                            task.get_name(), self.timeout_s * 4)
        batch = self._take(self.clock())
        if batch:
            try:  # the last changes, briefly
                async with asyncio.timeout(self.timeout_s):
                    await self._publish(batch)
            except Exception:  # noqa: BLE001
                pass
        await self.log.aclose()

    # -- publishing -------------------------------------------------------------------------
    async def _publisher(self) -> None:
        retry_at = -math.inf
        while not self._stopping:
            await asyncio.sleep(self.interval_s)
            now = self.clock()
            self._tick(now)  # peers' loads expire even while Redis is down
            for peer in [p for p, t in self.peers.items() if now - t > PEER_FORGET_S]:
                del self.peers[peer]  # replicas that left (each start takes a new id)
            if now < retry_at:
                continue
            batch = self._take(now)
            if not batch:  # most rounds: nothing for Redis, and no task made for it
                continue
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._publish(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any Redis trouble: local state only
                self._failed(exc)
                retry_at = now + self.retry_after_s

    def _tick(self, now: float) -> None:
        for channel in self.channels.values():
            try:
                channel.tick(now)
            except Exception:  # noqa: BLE001 - a bug in one channel must not stop the publisher
                self.counts["error"] += 1
                log.exception("replica sync: channel %s failed to expire its peers' state",
                              channel.name)

    def _take(self, now: float) -> dict[str, list]:
        """Each channel's changes to publish now (empty: nothing new)."""
        batch: dict[str, list] = {}
        for name, channel in self.channels.items():
            try:
                items = channel.take(now)
            except Exception:  # noqa: BLE001 - as in _tick: one channel's bug stops nothing else
                self.counts["error"] += 1
                log.exception("replica sync: channel %s failed to take its changes", name)
                continue
            if items is not None:
                batch[name] = items
        return batch

    async def _publish(self, batch: dict[str, list]) -> None:
        """One entry to the stream; on failure the channels keep their changes."""
        payload = _encode(_Entry(self.replica_id, batch))
        if len(payload) > MAX_ENTRY_BYTES:  # sharing is best effort: dropped, counted
            self.counts["oversized"] += 1
            return
        try:
            await self.log.append(payload)
        except BaseException:
            for name, items in batch.items():
                self.channels[name].put_back(items)
            raise
        self.counts["published"] += 1
        self._succeeded()

    # -- reading ----------------------------------------------------------------------------
    async def _reader(self) -> None:
        block_ms = max(1, int(self.interval_s * 2000))
        while not self._stopping:
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancel that
                # arrives as its awaitable finishes, and this loop would then outlive aclose()
                if self._live_from is None:  # at start and after an outage: where history ends
                    async with asyncio.timeout(self.timeout_s):
                        self._live_from = _id(await self.log.last_id())
                async with asyncio.timeout(self.timeout_s + block_ms / 1000):
                    entries = await self.log.read(self._last_id, block_ms)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._failed(exc)
                self._live_from = None
                await asyncio.sleep(self.retry_after_s)
                continue
            self._succeeded()
            for entry_id, payload in entries:
                self._last_id = entry_id
                try:
                    await self._apply(entry_id, payload)
                except Exception as exc:  # noqa: BLE001 - a peer's entry never stops the reader
                    self.counts["unreadable"] += 1
                    log.debug("replica sync: unreadable entry %s: %r", entry_id, exc)

    async def _apply(self, entry_id: str, payload: bytes) -> None:
        live = self._live_from is None or _id(entry_id) > self._live_from
        # Stream ids are Redis's clock in ms: a history entry's age is against the newest entry
        # (checked before decoding: an expired entry costs nothing more).
        if not live and (self._live_from[0] - _id(entry_id)[0]) / 1000 > self.history_s:
            self.counts["expired"] += 1
            return
        if len(payload) > MAX_ENTRY_BYTES:
            self.counts["unreadable"] += 1
            return
        try:
            entry = (_decode(payload) if len(payload) <= DECODE_IN_THREAD_BYTES
                     else await asyncio.to_thread(_decode, payload))
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            self.counts["unreadable"] += 1
            return
        if entry.origin == self.replica_id:
            return
        now = self.clock()
        if live:
            self.peers[entry.origin] = now
        for name, items in entry.channels.items():
            channel = self.channels.get(name)  # a channel this replica lacks: not its concern
            if channel is None or (channel.live_only and not live):
                continue
            try:
                channel.apply(entry.origin, items, now)
            except Exception as exc:  # noqa: BLE001 - another version, or a hostile entry
                self.counts["unreadable"] += 1
                log.debug("replica %s: unreadable %s entry: %s", entry.origin, name, exc)
        self.counts["applied"] += 1

    # -- failures ---------------------------------------------------------------------------
    def _failed(self, exc: BaseException) -> None:
        now = self.clock()
        self.counts["error"] += 1
        self.up = False
        if now - self._logged_at >= self.log_every_s:
            self._logged_at = now
            reason = "timed out" if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}"
            log.warning("replica sync through Redis %s failed (%s); routing from this router's own "
                        "state (%d errors so far; logged at most once a minute)",
                        redacted(self.log.url), reason, self.counts["error"])

    def _succeeded(self) -> None:
        if not self.up:
            self.up = True
            log.info("replica sync through Redis %s up (replica %s)", redacted(self.log.url), self.replica_id)

    def collector(self) -> "SyncCollector":
        return SyncCollector(self)


class SyncCollector:
    """/metrics: the sync's counters, whether Redis answers, and how many peers spoke lately."""

    def __init__(self, sync: ReplicaSync) -> None:
        self.sync = sync

    def collect(self):
        sync = self.sync
        events = CounterMetricFamily("pd_router_replica_sync_events", "Replica sync: entries "
                                     "published and applied, Redis errors, unreadable entries, "
                                     "history entries skipped as expired", labels=["event"])
        for event, count in sync.counts.items():
            events.add_metric([event], count)
        yield events
        yield GaugeMetricFamily("pd_router_replica_sync_up", "1 while the last Redis command of "
                                "the replica sync succeeded", value=1.0 if sync.up else 0.0)
        recent = sum(1 for t in sync.peers.values() if sync.clock() - t < 10.0)
        yield GaugeMetricFamily("pd_router_replica_peers", "Other replicas heard from in the "
                                "last 10 s", value=recent)


def redacted(url: str) -> str:
    """The URL without a password (redis://user:secret@host -> redis://user:***@host)."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at or ":" not in creds:
        return url
    return f"{scheme}{sep}{creds.split(':', 1)[0]}:***@{host}"



def replica_sync_for(spec) -> ReplicaSync:
    """The sync a router's `sessions` section asks for (redis_url set); channels are added by
    the router (loads) and its model groups (pins, prefixes)."""
    return ReplicaSync(RedisLog(spec.redis_url, spec.redis_prefix + "replicas", spec.redis_timeout_s,
                                spec.redis_stream_len, spec.ttl_s, spec.redis_password),
                       interval_s=spec.sync_interval_s, history_s=spec.ttl_s)
