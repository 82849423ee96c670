"""An LMCache pool that holds each block's KV heads as `head_groups` separate chunks, so that
engines of different TP sizes share it (PdLMCacheConnector's `head_groups`, issue 29).

LMCache keys a chunk by its tokens, the model name (our layout fingerprint) and the worker's place
(`worker_id` of `world_size`). Without head groups a TP 2 prefill stores two half-head chunks as
workers 0 and 1 of 2, and a TP 1 decode asks for worker 0 of 1: it never finds them. Here a
chunk's place is its head group instead: group g of G is stored as worker g of G, whichever rank
holds it. A rank of a TP t engine holds groups rank * G/t .. (rank + 1) * G/t - 1, each in an
LMCache engine of its own (LMCache's key is fixed per engine), copying its heads of every block
through a view of the engine's KV tensors. A TP 2 prefill's ranks store one group each; a TP 1
decode's one worker retrieves both into its blocks.

A chunk counts only when every group of it is there: lookups, stores and retrievals answer the
least any group answers, so a block of which one group is missing is a failed load (recomputed),
never half another prompt's heads. Engine-agnostic: torch only; needs the heads as the dimension
after the block one (vLLM's CPU layout), checked when the KV is attached.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from pd_plugins.transfer.lmcache_client import LMCacheClient
from pd_plugins.transfer.paged_kv import block_dim


def groups_of_rank(head_groups: int, tp_size: int, rank: int) -> range:
    """The head groups rank `rank` of a TP `tp_size` engine holds."""
    if head_groups % tp_size:
        raise ValueError(f"head_groups {head_groups} is not a multiple of the TP size {tp_size}")
    per_rank = head_groups // tp_size
    return range(rank * per_rank, (rank + 1) * per_rank)


class HeadGroupPools:
    """Several LMCache pools, one per head group this rank holds, behind one LMCacheClient.
    `open_group(group)` opens the pool of one group (worker `group` of `head_groups`, blocks of
    one group's heads)."""

    def __init__(self, groups: range, open_group: Callable[[int], LMCacheClient]) -> None:
        self.groups = groups
        self.pools: list[LMCacheClient] = []
        try:
            for group in groups:
                self.pools.append(open_group(group))
        except BaseException:
            self.close()
            raise

    def attach_kv(self, layers: list[torch.Tensor], num_blocks: int) -> None:
        """Each group's pool gets views of its heads of every block (dimension 1 after the block
        dimension); writes through the views land in the engine's blocks."""
        views = [t.movedim(block_dim(t, num_blocks), 0) for t in layers]
        per_rank = len(self.pools)
        for view in views:
            if view.dim() < 2 or view.shape[1] % per_rank:
                raise ValueError(f"KV tensor {tuple(view.shape)}: its second dimension (KV "
                                 f"heads) does not split into this rank's {per_rank} head groups")
        for j, pool in enumerate(self.pools):
            heads = [v.narrow(1, j * (v.shape[1] // per_rank), v.shape[1] // per_rank)
                     for v in views]
            pool.attach_kv(heads, num_blocks)

    def lookup(self, tokens: Sequence[int], namespace: str = "") -> int:
        return min(pool.lookup(tokens, namespace) for pool in self.pools)

    def store(self, tokens: Sequence[int], block_ids: Sequence[int], namespace: str = "") -> int:
        return min(pool.store(tokens, block_ids, namespace) for pool in self.pools)

    def retrieve(self, tokens: Sequence[int], block_ids: Sequence[int],
                 skip_tokens: int = 0, namespace: str = "") -> int:
        return min(pool.retrieve(tokens, block_ids, skip_tokens, namespace)
                   for pool in self.pools)

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
