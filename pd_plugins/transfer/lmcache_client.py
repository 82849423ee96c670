"""What a connector needs of an LMCache pool, whichever side of LMCache holds the KV: an engine in
this process (`LMCachePool`, lmcache_pool.py) or an LMCache server (`LMCacheMPClient`,
lmcache_mp.py, `mp://`). Both key chunks by the prompt's tokens, our layout fingerprint and a
namespace, count in tokens (whole chunks), and report a backend's failures as 0 tokens, never
as exceptions.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class LMCacheClient(Protocol):
    def attach_kv(self, layers: list[torch.Tensor], num_blocks: int) -> None:
        """Worker side: the engine's per-layer paged KV tensors, before any store or retrieve."""

    def lookup(self, tokens: Sequence[int], namespace: str = "") -> int:
        """Leading tokens the pool holds (a multiple of the chunk size); 0 on failure."""

    def store(self, tokens: Sequence[int], block_ids: Sequence[int], namespace: str = "") -> int:
        """Store the full chunks of `tokens` (token i in block `block_ids[i // block_size]`);
        returns the tokens stored (0 on failure)."""

    def retrieve(self, tokens: Sequence[int], block_ids: Sequence[int],
                 skip_tokens: int = 0, namespace: str = "") -> int:
        """Load the leading chunks present into `block_ids`, leaving tokens below `skip_tokens`
        alone; returns the leading tokens now valid (0 on failure)."""

    def close(self) -> None:
        """Release the pool; idempotent."""
