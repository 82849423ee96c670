"""Which worker holds which prompt prefix: a block-key index per worker, for the scorers.

Block keys (pd_plugins/vocab/block_keys.py) are chained hashes over full blocks of tokens. Two ways
to fill the index:

- exact: the worker's vLLM KV events (kv_sources/events.py) store and remove its keys.
- approximate: with events off, the router records the blocks of every prompt it routed to a
  worker.
Either way a worker's entries are bounded by `capacity_blocks`: past it the least recently stored
are forgotten (an engine that never reports removals cannot grow the router's memory).

A worker that maps a shared KV pool also holds whatever the pool holds (kv_sources/pools.py): its
match is the longer of the two.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from pd_plugins.routers.kv_sources.pools import LearnedPoolView, PoolView


class PrefixIndex:
    def __init__(self, capacity_blocks: int = 200_000) -> None:
        self.capacity_blocks = capacity_blocks
        # worker url -> block keys it holds (ordered oldest first, for approximate eviction)
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self.exact_workers: set[str] = set()
        # worker url -> the KV pool it is on
        self._pools: dict[str, PoolView] = {}

    def attach_pool(self, worker_url: str, view: PoolView) -> None:
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
        self.hold(worker_url, keys)

    def hold(self, worker_url: str, keys: Iterable[int]) -> None:
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

    def forget_blocks(self, worker_url: str) -> None:
        """The worker dropped its whole cache (exact mode: AllBlocksCleared, or a restart)."""
        self._blocks.pop(worker_url, None)

    # -- exact mode: the engine says what it stores and removes -----------------------------
    def store_keys(self, worker_url: str, keys: Iterable[int]) -> None:
        """Exact mode with keys already in the router's scheme (the cluster simulator's events)."""
        self.exact_workers.add(worker_url)
        self.hold(worker_url, keys)

    def remove_keys(self, worker_url: str, keys: Iterable[int]) -> None:
        held = self._blocks.get(worker_url)
        if held is not None:
            for key in keys:
                held.pop(key, None)
