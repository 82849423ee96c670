"""Pull-mode late reads (issue 10): a decode that reads KV blocks after the prefill's lease on them
ran out must never answer from them.

The race is provoked on purpose: a short lease, and a decode leg that only arrives after it
expired, while two filler prefills reuse the freed blocks (a 17-block KV pool leaves them no
choice). Upstream's NixlConnector reads the reused blocks and answers from another prompt's KV;
PdNixlConnector's lease check catches every such read and recomputes, so the output still equals
aggregated serving.
"""

from __future__ import annotations

import time

import pytest

from pd_plugins.testing.engine_harness import metric_value
from pd_plugins.testing.pd_client import completion
from tests.e2e.deployments import (
    FULL_MATRIX_ONLY,
    PROMPTS,
    SWAP_A,
    PdConfig,
    completion_body,
    output_ids,
    token_prompt,
)

pytestmark = pytest.mark.e2e

LEASE_SECONDS = 2
PAST_LEASE_S = LEASE_SECONDS + 1.5
NUM_BLOCKS = 17  # 16 usable blocks of 32 tokens (one is vLLM's null block)
FILLER = token_prompt(15 * 32 - 8, seed=4242)  # takes 15 of the 16 blocks
LATE_PROMPTS = [PROMPTS[64], PROMPTS[100], SWAP_A]


def late_config(connector: str) -> PdConfig:
    return PdConfig("tiny-llama", "pull", prefix_caching=False, failure_policy="recompute",
                    lease_seconds=LEASE_SECONDS, connector=connector, num_blocks=NUM_BLOCKS)


def late_pd_request(pd, prompt: list[int]):
    """Prefill, let the lease run out while fillers reuse the blocks, then decode."""
    params = pd.prefill_only(completion_body(prompt))
    time.sleep(PAST_LEASE_S)
    for _ in range(2):  # the first one's step reaps the expired lease; the second reuses the blocks
        filler = completion(pd.prefill.url, completion_body(FILLER, max_tokens=1))
        assert filler.status_code == 200, filler.text
    return completion(pd.decode.url, {**completion_body(prompt), "kv_transfer_params": params})


def poke(server) -> None:
    """One tiny request: an idle engine handles pending NIXL notifications in its next step."""
    assert completion(server.url, completion_body(PROMPTS[20], max_tokens=1)).status_code == 200


def counter(server, name: str) -> float:
    return metric_value(server.metrics(), name)


def wait_for_counter(server, name: str, at_least: float, timeout_s: float = 15.0) -> float:
    """Engine stats reach /metrics a little after the step that counted them."""
    deadline = time.monotonic() + timeout_s
    while (value := counter(server, name)) < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


@FULL_MATRIX_ONLY  # shows upstream's race, not our code: the full matrix (make test-full) runs it
def test_upstream_nixl_answers_from_released_blocks(pool, references):
    """The race, shown on upstream's connector: this is what the lease check exists for."""
    pd = pool.get(late_config("NixlConnector"))
    expected = references["tiny-llama"]
    wrong = [p for p in LATE_PROMPTS
             if output_ids(late_pd_request(pd, p)) != expected[tuple(p)]]
    poke(pd.prefill)
    late = wait_for_counter(pd.prefill, "vllm:nixl_num_notifications_after_expiry_total",
                            len(LATE_PROMPTS))
    assert late >= len(LATE_PROMPTS), "the prefill saw no late read: the race was not provoked"
    assert wrong, "upstream read released blocks but every output still matched: no reuse?"


def test_pd_nixl_detects_every_late_read_and_recomputes(pool, references):
    pd = pool.get(late_config("PdNixlConnector"))
    expected = references["tiny-llama"]
    for prompt in LATE_PROMPTS:
        assert output_ids(late_pd_request(pd, prompt)) == expected[tuple(prompt)]
    poke(pd.prefill)
    # The provoked reads are late; on a slow machine a 2 s lease can make others late too. Every
    # late read the prefill saw must be one the decode caught, and nothing else.
    detected = wait_for_counter(pd.decode, "vllm:pd_nixl_late_reads_total", len(LATE_PROMPTS))
    late_at_prefill = wait_for_counter(
        pd.prefill, "vllm:nixl_num_notifications_after_expiry_total", detected)
    assert late_at_prefill >= len(LATE_PROMPTS), "the race was not provoked"
    assert detected == late_at_prefill
    assert counter(pd.decode, "vllm:pd_nixl_lease_check_timeouts_total") == 0
    assert counter(pd.decode, "vllm:pd_nixl_recomputes_total") >= detected
    assert counter(pd.decode, "vllm:pd_nixl_unchecked_reads_total") == 0
    # A read right after is checked and used; if it is recomputed, only because it was late too.
    recomputes = counter(pd.decode, "vllm:pd_nixl_recomputes_total")
    assert output_ids(pd.complete(completion_body(PROMPTS[150]))) == expected[tuple(PROMPTS[150])]
    time.sleep(2)
    new_late = counter(pd.decode, "vllm:pd_nixl_late_reads_total") - detected
    assert counter(pd.decode, "vllm:pd_nixl_recomputes_total") - recomputes == new_late
