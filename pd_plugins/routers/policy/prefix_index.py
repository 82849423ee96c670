"""Which worker holds which prompt prefix: a block-key index per worker.

A block key is a chained hash over a full block of tokens (the same chaining vLLM uses, with our own
hash so the router never depends on the engine's hash algorithm or seed). Two ways to fill it:

- exact: vLLM KV events over ZMQ (`--kv-events-config`). BlockStored events carry the tokens of
  each block, so the router recomputes its own keys and maps the engine's hashes onto them;
  BlockRemoved and AllBlocksCleared take them out again.
- approximate: with events off, the router records the blocks of every prompt it routed to a
  worker.
Either way a worker's entries are bounded by `capacity_blocks`: past it the least recently stored
are forgotten (an engine that never reports removals cannot grow the router's memory).

Events come from the network: a malformed one is counted and skipped (`EventRejected`), never
fatal to the subscriber, and the router binds an events socket on loopback (or a private ipc
path) unless the operator opts in to another address.

A worker that maps a shared KV pool (PdShmConnector) also holds whatever the pool holds
(pool_index.py): its match is the longer of the two.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from collections import OrderedDict
from typing import Any, Iterable, Sequence
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from pd_plugins.routers.policy.pool_index import LearnedPoolView, PoolPrefixView

log = logging.getLogger("pd_router.prefix_index")

ROOT_KEY = 0x9E3779B97F4A7C15  # the parent of a prompt's first block
MAX_BATCH_BYTES = 16 << 20  # a bigger KV event batch is dropped by ZMQ (vLLM's are far smaller)
REJECT_LOG_INTERVAL_S = 60.0  # at most one warning per subscriber this often for bad batches


class EventRejected(ValueError):
    """A KV event the index cannot use (wrong shape or types); the batch's others still apply."""


def block_keys(tokens: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """Chained keys of every full block of `tokens` (a partial last block has no key)."""
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        keys.append(parent)
    return keys


def text_block_keys(text: str, block_size: int, chars_per_token: int = 4) -> list[int]:
    """Approximate keys for a text prompt when no tokenizer is configured."""
    width = block_size * chars_per_token
    keys, parent = [], ROOT_KEY
    for start in range(0, len(text) - width + 1, width):
        parent = hash((parent, text[start:start + width]))
        keys.append(parent)
    return keys


class PrefixIndex:
    def __init__(self, capacity_blocks: int = 200_000) -> None:
        self.capacity_blocks = capacity_blocks
        # worker url -> block keys it holds (ordered oldest first, for approximate eviction)
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        # worker url -> engine block hash -> our key (exact mode only; oldest first, bounded)
        self._engine_keys: dict[str, OrderedDict[object, int]] = {}
        self.exact_workers: set[str] = set()
        # worker url -> the KV pool it is on
        self._pools: dict[str, PoolPrefixView | LearnedPoolView] = {}

    def attach_pool(self, worker_url: str, view: PoolPrefixView | LearnedPoolView) -> None:
        self._pools[worker_url] = view

    def matched_blocks(self, worker_url: str, keys: Sequence[int]) -> int:
        """How many leading blocks of the prompt this worker holds (itself or in its pool)."""
        pool = self._pools.get(worker_url)
        in_pool = pool.matched_blocks(keys) if pool is not None else 0
        held = self._blocks.get(worker_url)
        if not held:
            return in_pool
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return max(count, in_pool)

    def record_stored_in_pool(self, worker_url: str, keys: Iterable[int]) -> None:
        """A prefill reported storing these blocks into its pool (learned pools only)."""
        pool = self._pools.get(worker_url)
        if isinstance(pool, LearnedPoolView):
            pool.record(keys)

    def held_blocks(self, worker_url: str) -> int:
        """How many blocks the index holds for this worker (its approximate cache size)."""
        return len(self._blocks.get(worker_url, ()))

    def record_routed(self, worker_url: str, keys: Iterable[int]) -> None:
        """Approximate mode: assume the worker now caches the prompt it was sent."""
        if worker_url in self.exact_workers:
            return
        self._hold(worker_url, keys)

    def _hold(self, worker_url: str, keys: Iterable[int]) -> None:
        """Mark `keys` most recently stored on the worker; forget the oldest past capacity."""
        held = self._blocks.setdefault(worker_url, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def forget_worker(self, worker_url: str) -> None:
        self._blocks.pop(worker_url, None)
        self._pools.pop(worker_url, None)
        self._engine_keys.pop(worker_url, None)

    # -- exact mode: vLLM KV events ---------------------------------------------------------
    def store_keys(self, worker_url: str, keys: Iterable[int]) -> None:
        """Exact mode with keys already in the router's scheme (the cluster simulator's events)."""
        self.exact_workers.add(worker_url)
        self._hold(worker_url, keys)

    def remove_keys(self, worker_url: str, keys: Iterable[int]) -> None:
        held = self._blocks.get(worker_url)
        if held is not None:
            for key in keys:
                held.pop(key, None)

    def apply_event(self, worker_url: str, event: Any) -> None:
        """Apply one vLLM KV event (as decoded from the wire); `EventRejected` if malformed,
        with the index unchanged."""
        if not isinstance(event, dict):
            raise EventRejected(f"an event must be a map, got {type(event).__name__}")
        kind = event.get("type")
        if kind == "BlockStored":
            self._apply_stored(worker_url, event)
        elif kind == "BlockRemoved":
            hashes = _engine_hashes(event.get("block_hashes"))
            held = self._blocks.get(worker_url)
            engine_keys = self._engine_keys.get(worker_url)
            for engine_hash in hashes if engine_keys is not None else ():
                key = engine_keys.pop(engine_hash, None)
                if key is not None and held is not None:
                    held.pop(key, None)
        elif kind == "AllBlocksCleared":
            self._blocks.pop(worker_url, None)
            self._engine_keys.pop(worker_url, None)
        # other event types (vLLM adds some) carry nothing the index uses

    def _apply_stored(self, worker_url: str, event: dict) -> None:
        size, tokens = event.get("block_size"), event.get("token_ids")
        hashes = _engine_hashes(event.get("block_hashes"))
        if not (isinstance(size, int) and not isinstance(size, bool) and size > 0):
            raise EventRejected(f"BlockStored.block_size must be a positive integer, "
                                f"got {size!r:.40}")
        if not (isinstance(tokens, list) and len(tokens) >= len(hashes) * size
                and set(map(type, tokens)) <= {int}):  # in C: events come on the request loop
            raise EventRejected("BlockStored.token_ids must be a list of integers covering "
                                "every block")
        parent_hash = event.get("parent_block_hash")
        if parent_hash is not None:
            _engine_hashes([parent_hash])
        engine_keys = self._engine_keys.setdefault(worker_url, OrderedDict())
        parent = ROOT_KEY if parent_hash is None else engine_keys.get(parent_hash)
        if parent is None:  # parent evicted or never seen: these blocks are unreachable
            return
        keys = []
        for i, engine_hash in enumerate(hashes):
            parent = hash((parent, tuple(tokens[i * size:(i + 1) * size])))
            engine_keys[engine_hash] = parent
            engine_keys.move_to_end(engine_hash)
            keys.append(parent)
        while len(engine_keys) > self.capacity_blocks:  # the same bound as the keys they map to
            engine_keys.popitem(last=False)
        self._hold(worker_url, keys)


def _engine_hashes(value: Any) -> list:
    """An event's engine block hashes: vLLM sends ints or bytes (ExternalBlockHash)."""
    if not (isinstance(value, list)
            and all(isinstance(h, (int, bytes)) and not isinstance(h, bool) for h in value)):
        raise EventRejected("block_hashes must be a list of integers or bytes")
    return value


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind_endpoint(endpoint: str, allow_any_host: bool) -> None:
    """Refuse to listen for KV events where another host could publish fake ones, unless the
    operator said so: tcp binds on loopback only, ipc (made private after the bind), inproc."""
    scheme, _, path = endpoint.partition("://")
    if scheme == "ipc" and path.startswith("@") and not allow_any_host:
        raise ValueError(f"kv_events bind:{endpoint}: an abstract ipc socket has no permissions "
                         "(any local user could publish to it); use a path in a private directory")
    if scheme in ("ipc", "inproc"):
        return
    if scheme != "tcp":
        raise ValueError(f"kv_events bind:{endpoint}: only tcp://, ipc:// or inproc:// "
                         "can be bound")
    host = urlsplit(endpoint).hostname or ""
    if not _is_loopback(host) and not allow_any_host:
        raise ValueError(
            f"kv_events bind:{endpoint} would accept KV events from any host that reaches "
            f"{host or '*'}; bind a loopback address (or an ipc:// path), or set the worker "
            "option kv_events_bind_any=true to accept them from the network")


def _bind_privately(sock: zmq.Socket, endpoint: str) -> None:
    """Bind; an ipc socket file is made accessible to this user only (umask during the bind,
    so no other user can connect before the chmod)."""
    if not endpoint.startswith("ipc://"):
        sock.bind(endpoint)
        return
    old = os.umask(0o177)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)
    os.chmod(endpoint[len("ipc://"):], 0o600)


class KvEventSubscriber:
    """Feeds one worker's vLLM KV events (ZMQ SUB) into the index until cancelled.

    vLLM binds its PUB socket only for wildcard (`tcp://*:5557`) or ipc endpoints and connects to
    any other. So `endpoint` is either where the engine binds (the router connects), or
    `bind:tcp://127.0.0.1:5557`: the router binds there and the engine's config names that address.
    """

    def __init__(self, index: PrefixIndex, worker_url: str, endpoint: str, topic: str = "",
                 allow_any_host: bool = False) -> None:
        self.index, self.worker_url, self.endpoint, self.topic = index, worker_url, endpoint, topic
        if endpoint.startswith("bind:"):
            check_bind_endpoint(endpoint[5:], allow_any_host)  # at configuration time
        self.events_applied = 0
        self.events_rejected = 0   # malformed events skipped (their batch's others applied)
        self.batches_rejected = 0  # undecodable batches skipped whole
        self.last_seq = -1
        self._last_reject_log = float("-inf")

    async def run(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        try:
            if self.endpoint.startswith("bind:"):
                _bind_privately(sock, self.endpoint[5:])  # the engine connects to us
            else:
                sock.connect(self.endpoint)  # the engine binds (`tcp://*:PORT` in its config)
        except BaseException as exc:
            log.error("cannot subscribe to KV events of %s at %s: %s", self.worker_url,
                      self.endpoint, exc)
            sock.close(linger=0)
            raise
        self.index.exact_workers.add(self.worker_url)
        log.info("subscribed to KV events of %s at %s", self.worker_url, self.endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    self.handle(frames)
                except Exception:  # a bug here must not end the subscription either
                    self.batches_rejected += 1
                    log.exception("KV events of %s: a batch could not be applied", self.worker_url)
        finally:
            self.index.exact_workers.discard(self.worker_url)
            sock.close(linger=0)

    def handle(self, frames: list[bytes]) -> None:
        """One multipart message from the PUB socket: [topic, seq, msgpack batch]. Anything
        malformed is counted and skipped; nothing here raises."""
        if len(frames) != 3:
            self._rejected_batch(f"{len(frames)} frames, expected 3")
            return
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes[:8], "big")
        if self.last_seq >= 0 and seq != self.last_seq + 1:
            log.warning("KV events of %s: missed %d batches", self.worker_url,
                        seq - self.last_seq - 1)
        self.last_seq = seq
        try:
            batch = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError as exc:
            self._rejected_batch(f"undecodable: {exc}")
            return
        # vLLM's EventBatch is array-like: [ts, events, data_parallel_rank?]
        if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list)):
            self._rejected_batch("not an event batch ([ts, [events...], ...])")
            return
        rejected = None
        for event in batch[1]:
            try:
                self.index.apply_event(self.worker_url, event)
                self.events_applied += 1
            except EventRejected as exc:
                self.events_rejected += 1
                rejected = exc
        if rejected is not None:
            self._log_rejection(f"skipped malformed events (last: {rejected})")

    def _rejected_batch(self, why: str) -> None:
        self.batches_rejected += 1
        self._log_rejection(f"skipped a KV event batch: {why}")

    def _log_rejection(self, message: str) -> None:
        now = time.monotonic()  # a hostile or broken publisher must not flood the log
        if now - self._last_reject_log >= REJECT_LOG_INTERVAL_S:
            self._last_reject_log = now
            log.warning("KV events of %s: %s (%d batches, %d events rejected so far)",
                        self.worker_url, message, self.batches_rejected, self.events_rejected)
