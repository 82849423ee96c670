"""The pool connectors refuse a state-space model in the first call vLLM's engine core makes
with the model's config, with a message that names the connector, the model and what to use."""

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
