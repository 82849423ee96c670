"""What makes two vLLM engines' KV blocks interchangeable, for connectors whose pool is shared.

A pool (shared memory, LMCache) serves one layout: engines whose blocks differ in model, dtype,
block size, layers, page size, parallelism or block hash must never read each other's KV.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pd_plugins.transfer.paged_kv import block_dim

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# hash algorithms whose block hashes differ between processes unless PYTHONHASHSEED is set
_NON_REPRODUCIBLE_HASHES = ("xxhash", "xxhash_cbor", "builtin", "sha256_cbor_64bit_builtin")


@dataclass(frozen=True)
class KVLayout:
    description: str        # "<tag>|model=...|dtype=...|..." (put into pool ids and keys)
    layer_names: list[str]  # the KV cache group's layers, in order
    page_bytes: int         # one block of one layer
    block_size: int         # tokens per block

    @property
    def block_bytes(self) -> int:  # one block of every layer
        return self.page_bytes * len(self.layer_names)


def refuse_state_space_models(vllm_config: VllmConfig, connector: str) -> None:
    """A pool stores attention KV blocks, one group; a model with state-space layers (Mamba,
    Gated DeltaNet: Qwen3-Next, Granite 4 hybrids, Jamba) keeps per-request state beside them,
    which needs vLLM's hybrid allocator. Without it vLLM fails at startup with "Failed to promote
    local KV cache specs to one unified type", naming neither the connector nor the cause."""
    model = vllm_config.model_config
    if model is None or not (model.is_hybrid or model.has_inner_state):
        return
    arch = ", ".join(getattr(model, "architectures", None) or [str(model.model)])
    raise ValueError(
        f"{connector} does not move state-space state: {arch} has Mamba or linear-attention "
        "layers, whose per-request state a KV block pool cannot hold. Serve this model with "
        "PdNixlConnector (its transfer covers vLLM's hybrid KV cache groups; not tested on CPU, "
        "docs/connectors.md \"Attention kinds\") or without a KV connector")


def kv_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, tag: str,
              connector: str, head_groups: int | None = None) -> KVLayout:
    """`head_groups`: the pool holds each block as that many slots of KV heads (a multiple of
    this engine's TP size), so that engines of any TP size dividing it share one layout; None:
    one slot per rank's block, the layout tied to this TP size."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"{connector} supports models with one KV cache group "
                         f"(this model has {len(groups)})")
    spec, layers = groups[0].kv_cache_spec, groups[0].layer_names
    cache, model, par = (vllm_config.cache_config, vllm_config.model_config,
                         vllm_config.parallel_config)
    algo = cache.prefix_caching_hash_algo
    if algo in _NON_REPRODUCIBLE_HASHES and os.getenv("PYTHONHASHSEED") is None:
        raise ValueError(f"{connector}: --prefix-caching-hash-algo {algo} gives each process "
                         "different block hashes unless PYTHONHASHSEED is set; use sha256")
    tp, page = par.tensor_parallel_size, spec.page_size_bytes
    if head_groups is None:
        split = f"tp={tp}"
    else:
        heads = getattr(spec, "num_kv_heads", 0) * tp  # the spec holds one rank's heads
        if head_groups % tp or not heads or heads % head_groups:
            raise ValueError(f"{connector}: head_groups {head_groups} must be a multiple of "
                             f"this engine's TP size ({tp}) and divide the model's {heads} KV "
                             "heads")
        page //= head_groups // tp
        split = f"head_groups={head_groups}"
    description = (f"{tag}|model={model.model}|rev={model.revision}|dtype={model.dtype}"
                   f"|kv_dtype={cache.cache_dtype}|block={cache.block_size}|layers={len(layers)}"
                   f"|page={page}|{split}|pp={par.pipeline_parallel_size}|hash={algo}")
    return KVLayout(description, list(layers), page, cache.block_size)


def require_heads_outermost(tensors: list[torch.Tensor], num_blocks: int, kv_cache_spec,
                            connector: str) -> None:
    """A pool that splits each block into head groups copies a slice of the dimension after the
    block one, which must then be the KV heads (vLLM's CPU layout [blocks, heads, block_size,
    2 * head_size]; the flash layout [2, blocks, block_size, heads, head_size] would split K
    from V instead, silently)."""
    heads = getattr(kv_cache_spec, "num_kv_heads", None)
    if any(t.movedim(block_dim(t, num_blocks), 0).shape[1] != heads for t in tensors):
        raise ValueError(f"{connector}: head_groups needs each block's KV heads as its outer "
                         "dimension (vLLM's CPU layout); this engine's KV tensors are "
                         f"{tuple(tensors[0].shape)}")
