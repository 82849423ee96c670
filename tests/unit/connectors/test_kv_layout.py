"""The pool connectors refuse a state-space model in the first call vLLM's engine core makes
with a message that names the connector, the model and what to use; head groups need the KV
heads right after the block dimension."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from pd_plugins.connectors.vllm.pd_lmcache import PdLMCacheConnector  # noqa: E402
from pd_plugins.connectors.vllm.pd_shm import PdShmConnector  # noqa: E402


def config(is_hybrid: bool = False, has_inner_state: bool = False):
    return SimpleNamespace(model_config=SimpleNamespace(
        is_hybrid=is_hybrid, has_inner_state=has_inner_state, model="/models/x",
        architectures=["GraniteMoeHybridForCausalLM"]))


@pytest.mark.parametrize("connector", [PdShmConnector, PdLMCacheConnector])
def test_pool_connectors_refuse_state_space_models_before_vllm_sizes_the_cache(connector):
    assert connector.get_required_kvcache_layout(config()) is None  # attention only: no preference
    for kind in ({"is_hybrid": True}, {"has_inner_state": True}):  # hybrid, or Mamba alone
        with pytest.raises(ValueError) as refused:
            connector.get_required_kvcache_layout(config(**kind))
        message = str(refused.value)
        assert message.startswith(f"{connector.__name__} does not move state-space state")
        assert "GraniteMoeHybridForCausalLM" in message and "PdNixlConnector" in message


def test_head_groups_need_the_heads_right_after_the_block_dimension():
    """Splitting a block into head groups slices the dimension after the block one: in vLLM's
    flash layout that is K/V, which would move K where V belongs, so it is refused."""
    import torch

    from pd_plugins.connectors.vllm.kv_layout import require_heads_outermost

    spec = SimpleNamespace(num_kv_heads=4)
    cpu = [torch.zeros(8, 4, 16, 32)]          # [blocks, heads, block_size, 2 * head_size]
    require_heads_outermost(cpu, 8, spec, "PdShmConnector")
    flash = [torch.zeros(2, 8, 16, 4, 16)]     # [2, blocks, block_size, heads, head_size]
    with pytest.raises(ValueError, match="PdLMCacheConnector: head_groups needs each block's KV "
                                         "heads as its outer dimension"):
        require_heads_outermost(flash, 8, spec, "PdLMCacheConnector")
