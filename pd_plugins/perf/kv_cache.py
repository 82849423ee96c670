"""An instance's KV memory: bounded blocks, a prefix cache of full blocks, LRU eviction.

Blocks come in two kinds. Keyed blocks hold a full block of a prompt and are found again by their
chained key (a prefix cache, as vLLM's automatic prefix caching); private blocks hold a request's
partial last block and its output. A running request pins its blocks; when it finishes its keyed
blocks stay resident, unpinned, and are evicted least recently used first when space is needed.
Callbacks report stored and evicted keys so an engine can publish vLLM-style KV events.

An optional host tier (`host_capacity_blocks` > 0) holds copies of keyed blocks in host memory, as
vLLM's CPU offloading or LMCache's local CPU backend do: every keyed block is written through to it
when it is stored, and it evicts least recently used first on its own, larger budget. A prompt whose
prefix has left device memory can still find the next blocks there (`match_host`) and load them
instead of computing them. KV events report device blocks only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

KeysCallback = Callable[[list[int]], None]


class KvCache:
    def __init__(self, capacity_blocks: int, on_stored: KeysCallback | None = None,
                 on_removed: KeysCallback | None = None, host_capacity_blocks: int = 0) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be > 0")
        if host_capacity_blocks < 0:
            raise ValueError("host_capacity_blocks must be >= 0")
        self.capacity_blocks = capacity_blocks
        self.host_capacity_blocks = host_capacity_blocks
        self.on_stored, self.on_removed = on_stored, on_removed
        self._resident: OrderedDict[int, int] = OrderedDict()  # key -> pin count, oldest first
        self._host: OrderedDict[int, None] = OrderedDict()     # host tier, oldest first
        self.private_blocks = 0
        self.pinned_keyed_blocks = 0
        self.evicted_blocks = 0

    @property
    def used_blocks(self) -> int:
        return len(self._resident) + self.private_blocks

    @property
    def in_use_blocks(self) -> int:
        """Blocks running requests hold: what vLLM reports as KV usage (cached but unpinned
        blocks count as free there, since they can be evicted at once)."""
        return self.pinned_keyed_blocks + self.private_blocks

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - self.used_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._resident)

    def match(self, keys: Sequence[int]) -> int:
        """How many leading keys are resident (the prefix-cache hit, in blocks)."""
        n = 0
        for key in keys:
            if key not in self._resident:
                break
            n += 1
        return n

    def match_host(self, keys: Sequence[int], start: int) -> int:
        """How many keys from `start` on (the first block the device lacks) the host tier holds
        in a row: the blocks a request can load instead of compute. Marks them recently used, and
        the host copies of the device's hits before them too (a prefix hot on the device keeps its
        host copy for when the device evicts it)."""
        for key in keys[:start]:
            if key in self._host:
                self._host.move_to_end(key)
        n = 0
        for key in keys[start:]:
            if key not in self._host:
                break
            self._host.move_to_end(key)
            n += 1
        return n

    @property
    def host_blocks(self) -> int:
        return len(self._host)

    def _write_through(self, keys: Sequence[int]) -> None:
        if not self.host_capacity_blocks:
            return
        host = self._host
        for key in keys:
            host[key] = None
            host.move_to_end(key)
        while len(host) > self.host_capacity_blocks:
            host.popitem(last=False)

    def evictable_blocks(self) -> int:
        return sum(1 for pins in self._resident.values() if pins == 0)

    def try_allocate(self, keys: Sequence[int], private_blocks: int) -> int | None:
        """Pin the prompt's keyed blocks (reusing the resident prefix) and reserve private ones.

        Returns the number of leading blocks that were already resident (the cache hit), or None,
        allocating nothing, when the blocks do not fit even after evicting every unpinned block."""
        hit = self.match(keys)
        missing = len(keys) - hit
        need = missing + private_blocks - self.free_blocks
        if need > 0:
            # Only blocks outside this prompt's own prefix may go (those are about to be pinned).
            prefix = set(keys[:hit])
            victims = []
            for key, pins in self._resident.items():
                if len(victims) >= need:
                    break
                if pins == 0 and key not in prefix:
                    victims.append(key)
            if len(victims) < need:
                return None
            for key in victims:
                del self._resident[key]
            self.evicted_blocks += len(victims)
            if self.on_removed:
                self.on_removed(victims)
        stored = []
        for key in keys:
            pins = self._resident.pop(key, None)
            if pins is None:
                stored.append(key)
                pins = 0
            if pins == 0:
                self.pinned_keyed_blocks += 1
            self._resident[key] = pins + 1  # re-inserted: most recently used
        self.private_blocks += private_blocks
        if stored:
            self._write_through(stored)
            if self.on_stored:
                self.on_stored(stored)
        return hit

    def release(self, keys: Sequence[int], private_blocks: int) -> None:
        """Unpin a finished request's blocks; keyed ones stay cached until evicted."""
        for key in keys:
            pins = self._resident.get(key)
            if pins:
                self._resident[key] = pins - 1
                if pins == 1:
                    self.pinned_keyed_blocks -= 1
        self.private_blocks -= private_blocks

    def insert_cached(self, keys: Sequence[int]) -> None:
        """Blocks a finished request completed with its output (the next turn's prompt will start
        with them): cached unpinned, as far as free space allows (they come from freed private
        blocks, so there normally is)."""
        stored = []
        for key in keys:
            if key in self._resident:
                self._resident.move_to_end(key)
            elif self.free_blocks > 0:
                self._resident[key] = 0
                stored.append(key)
        if stored:
            self._write_through(stored)
            if self.on_stored:
                self.on_stored(stored)

    def clear_cache(self) -> None:
        """Drop every unpinned block (vLLM's reset_prefix_cache)."""
        victims = [k for k, pins in self._resident.items() if pins == 0]
        for key in victims:
            del self._resident[key]
        if victims and self.on_removed:
            self.on_removed(victims)
