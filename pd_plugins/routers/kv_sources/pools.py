"""What a shared KV pool holds, for the prefix scorers: every worker on the pool can load it.

Two views: PoolPrefixView reads a shared-memory pool itself; LearnedPoolView learns an LMCache
pool's contents from the prefills' answers.

With PdShmConnector, engines on one host (or one CXL rack) share a KV pool
(pd_plugins/transfer/shm_pool.py). A block in the pool is as good as cached on every worker that
maps it, so the pool's contents count toward each such worker's prefix match, and which decode
worker a prefill's KV "lives near" stops mattering. The connector stores the router's own block
key (vocab/block_keys.py) beside each block; the router maps the pool read-only (O_RDONLY,
PROT_READ) and reads those keys, refreshed at most every `refresh_s` (a routing hint, read
without the pool's lock). A pool that cannot be read (not made yet, untrusted, truncated,
corrupt) is an unknown pool: it matches nothing and the router keeps serving; a pool file that
was removed or replaced (pd-pool remove, remove_when_unused) is mapped again at its new inode.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from pd_plugins.transfer.shm_pool import ShmKVPool

log = logging.getLogger("pd_router.pool_index")

LEARNED_POOL_PREFIX = "lmcache:"  # kv_pool=lmcache:<name>: an LMCache pool, learned from answers


def pool_view(kv_pool: str, group: str | int | None = None) -> PoolPrefixView | LearnedPoolView:
    """The view of a worker's `kv_pool` option: an LMCache pool's name, or a shm pool's path."""
    if kv_pool.startswith(LEARNED_POOL_PREFIX):
        return LearnedPoolView(kv_pool)
    return PoolPrefixView(kv_pool, group=group)


class PoolPrefixView:
    def __init__(self, path: str, refresh_s: float = 0.05, group: str | int | None = None) -> None:
        self.path, self.refresh_s, self.group = path, refresh_s, group
        self._pool: ShmKVPool | None = None
        self._inode: tuple[int, int] | None = None
        self._keys: frozenset[int] = frozenset()
        self._read_at = float("-inf")
        self._warned: str | None = None

    def _attach(self) -> ShmKVPool | None:
        if self._pool is not None and self._inode != _inode(self.path):
            self.close()  # removed or replaced: the mapping we hold is no engine's pool any more
        if self._pool is None:
            # imported here: the pool's module loads numba (its copy kernels), which a router
            # without a shm pool should not pay for at startup (~0.3 s, ~70 MiB)
            from pd_plugins.transfer.shm_pool import PoolError, ShmKVPool
            try:
                self._pool = ShmKVPool.attach(self.path, readonly=True, group=self.group)
                self._inode = self._pool.file_id()
                self._warned = None
                log.info("reading KV pool %s (%d slots)", self.path, self._pool.num_slots)
            except (PoolError, OSError) as exc:  # not made yet, or unfit: an unknown pool
                if self._warned != str(exc):
                    log.warning("KV pool %s not readable: %s", self.path, exc)
                    self._warned = str(exc)
        return self._pool

    def keys(self) -> frozenset[int]:
        now = time.monotonic()
        if now - self._read_at >= self.refresh_s:
            self._read_at = now
            pool = self._attach()
            self._keys = (frozenset(pool.published_content_keys().tolist()) if pool is not None
                          else frozenset())
        return self._keys

    def matched_blocks(self, keys: Sequence[int]) -> int:
        """How many leading blocks of the prompt the pool holds."""
        held = self.keys()
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool, self._inode = None, None


def _inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class LearnedPoolView:
    """An LMCache pool (PdLMCacheConnector, worker option `kv_pool=lmcache:<name>`) as the router
    learns it: each prefill answer says how many prompt tokens it stored (`lmcache_tokens`), and
    the prompt's leading block keys up to there are recorded, oldest dropped past `capacity_blocks`.
    The router cannot see LMCache evict; a stale entry costs a skipped prefill leg, after which
    the decode computes what the pool no longer has (the output is the same)."""

    def __init__(self, name: str, capacity_blocks: int = 200_000) -> None:
        self.name, self.capacity_blocks = name, capacity_blocks
        self._keys: OrderedDict[int, None] = OrderedDict()

    def record(self, keys: Iterable[int]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity_blocks:
            self._keys.popitem(last=False)

    def matched_blocks(self, keys: Sequence[int]) -> int:
        count = 0
        for key in keys:
            if key not in self._keys:
                break
            count += 1
        return count

    def close(self) -> None:
        self._keys.clear()


PoolView = PoolPrefixView | LearnedPoolView
