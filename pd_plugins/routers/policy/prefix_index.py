"""Which worker holds which prompt prefix: a block-key index per worker.

A block key is a chained hash over a full block of tokens (the same chaining vLLM uses, with our own
hash so the router never depends on the engine's hash algorithm or seed). Two ways to fill it:

- exact: vLLM KV events over ZMQ (`--kv-events-config`). BlockStored events carry the tokens of
  each block, so the router recomputes its own keys and maps the engine's hashes onto them;
  BlockRemoved and AllBlocksCleared take them out again.
- approximate: with events off, the router records the blocks of every prompt it routed to a
  worker, and forgets the oldest once a worker's entry count passes `capacity_blocks`.

A worker that maps a shared KV pool (PdShmConnector) also holds whatever the pool holds
(pool_index.py): its match is the longer of the two.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Iterable, Sequence

import msgspec
import zmq
import zmq.asyncio

from pd_plugins.routers.policy.pool_index import LearnedPoolView, PoolPrefixView

log = logging.getLogger("pd_router.prefix_index")

ROOT_KEY = 0x9E3779B97F4A7C15  # the parent of a prompt's first block


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
        # worker url -> engine block hash -> our key (exact mode only)
        self._engine_keys: dict[str, dict[object, int]] = {}
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
        held = self._blocks.setdefault(worker_url, OrderedDict())
        for key in keys:
            held[key] = None

    def remove_keys(self, worker_url: str, keys: Iterable[int]) -> None:
        held = self._blocks.get(worker_url)
        if held is not None:
            for key in keys:
                held.pop(key, None)

    def apply_event(self, worker_url: str, event: dict) -> None:
        kind = event.get("type")
        held = self._blocks.setdefault(worker_url, OrderedDict())
        engine_keys = self._engine_keys.setdefault(worker_url, {})
        if kind == "BlockStored":
            size = event["block_size"]
            tokens = event["token_ids"]
            parent_hash = event.get("parent_block_hash")
            parent = ROOT_KEY if parent_hash is None else engine_keys.get(parent_hash)
            if parent is None:  # parent evicted or never seen: these blocks are unreachable
                return
            for i, engine_hash in enumerate(event["block_hashes"]):
                parent = hash((parent, tuple(tokens[i * size:(i + 1) * size])))
                engine_keys[engine_hash] = parent
                held[parent] = None
        elif kind == "BlockRemoved":
            for engine_hash in event["block_hashes"]:
                key = engine_keys.pop(engine_hash, None)
                if key is not None:
                    held.pop(key, None)
        elif kind == "AllBlocksCleared":
            held.clear()
            engine_keys.clear()


class KvEventSubscriber:
    """Feeds one worker's vLLM KV events (ZMQ SUB) into the index until cancelled.

    vLLM binds its PUB socket only for wildcard (`tcp://*:5557`) or ipc endpoints and connects to
    any other. So `endpoint` is either where the engine binds (the router connects), or
    `bind:tcp://127.0.0.1:5557`: the router binds there and the engine's config names that address.
    """

    def __init__(self, index: PrefixIndex, worker_url: str, endpoint: str, topic: str = "") -> None:
        self.index, self.worker_url, self.endpoint, self.topic = index, worker_url, endpoint, topic
        self.events_applied = 0
        self.last_seq = -1

    async def run(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        if self.endpoint.startswith("bind:"):
            sock.bind(self.endpoint[5:])  # the engine connects to us (a non-wildcard endpoint)
        else:
            sock.connect(self.endpoint)  # the engine binds (`tcp://*:PORT` in its config)
        self.index.exact_workers.add(self.worker_url)
        decoder = msgspec.msgpack.Decoder()
        log.info("subscribed to KV events of %s at %s", self.worker_url, self.endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                _topic, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big")
                if self.last_seq >= 0 and seq != self.last_seq + 1:
                    log.warning("KV events of %s: missed %d batches", self.worker_url,
                                seq - self.last_seq - 1)
                self.last_seq = seq
                try:
                    _ts, events, *_ = decoder.decode(payload)
                except (msgspec.DecodeError, ValueError) as exc:
                    log.warning("undecodable KV event batch from %s: %s", self.worker_url, exc)
                    continue
                for event in events:
                    if isinstance(event, dict):
                        self.index.apply_event(self.worker_url, event)
                        self.events_applied += 1
        except asyncio.CancelledError:
            raise
        finally:
            self.index.exact_workers.discard(self.worker_url)
            sock.close(linger=0)
