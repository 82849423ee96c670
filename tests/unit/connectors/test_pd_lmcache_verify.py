"""PdLMCacheConnector's verified hand-off (issue 28, docs/plans/kv-verification.md §4.4) in vLLM's
real scheduler on CPU: each engine's real worker side stores into and retrieves from a real
LMCache engine on a shared directory (fs://), over real KV tensors, and its digests travel over
the real signature channel. The prefill states the digests of its prompt's blocks
(`pd.kv_digest`); the decode checks what it retrieved and says so (`pd.kv`). A stale chunk (the
prefill's `stale_chunk`: another prompt's KV under this prompt's key) and a damaged retrieved
block (the decode's `corrupt`) are caught, never used, and recomputed (or failed, per
kv_load_failure_policy). Only the forward pass is missing: the test plays the model runner
(vllm_scheduler.sample_one_token), and the KV tensors hold random "KV" of each engine's own.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from pd_plugins.transfer import kv_digest
from pd_plugins.transfer.kv_faults import ALLOWED_VAR, PRODUCTION_VAR
from pd_plugins.vocab.transfer_params import KvVerdict, kv_verdict_of, pd_section_of
from tests.unit.connectors.vllm_scheduler import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    computed_blocks,
    counted,
    decode_leg,
    keep_scheduler_stats,
    make_scheduler,
    prefill_leg,
    sample_one_token,
)

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

PROMPT = list(range(1, 41))  # 40 tokens: two full chunks (= blocks) of 16 and 8 tokens more


def prompt(i: int, length: int = len(PROMPT)) -> list[int]:
    """A prompt of its own (no chunk shared with another test prompt)."""
    return [3000 + i, *range(2, length + 1)]


class Engine:
    """One engine: vLLM's scheduler with PdLMCacheConnector and a worker-side connector of its
    own over a random KV cache."""

    def __init__(self, role: str, backend: str, failure_policy: str = "recompute",
                 **extra) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from pd_plugins.connectors.vllm.pd_lmcache import PdLMCacheConnector

        self.scheduler = make_scheduler("PdLMCacheConnector", role,
                                        {"backend": backend, **extra},
                                        engine_id=f"lmv-{uuid.uuid4().hex[:8]}",
                                        failure_policy=failure_policy)
        self.connector = self.scheduler.connector
        if self.connector.digests is not None:
            self.connector.digests.wait_s = 10  # a loaded host may deliver them late
        config = self.scheduler.kv_cache_config
        self.worker = PdLMCacheConnector(self.scheduler.vllm_config, KVConnectorRole.WORKER,
                                         config)
        gen = torch.Generator().manual_seed(int.from_bytes(uuid.uuid4().bytes[:4], "little"))
        self.cache = torch.rand(NUM_BLOCKS, 2, BLOCK_SIZE, 1, 1, generator=gen)
        self.worker.register_kv_caches({config.kv_cache_groups[0].layer_names[0]: self.cache})
        self.reports: list = []
        self.metas: list = []
        keep_scheduler_stats(self.connector, self.reports)

    def step(self, before_worker=None) -> dict:
        """One engine step; `before_worker(meta)`: what happens elsewhere between the schedule
        and the worker."""
        from vllm.v1.outputs import KVConnectorOutput

        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        self.metas.append(meta)
        if before_worker is not None:
            before_worker(meta)
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        self.compute(output)
        w.wait_for_save()
        report = KVConnectorOutput(invalid_block_ids=w.get_block_ids_with_load_errors(),
                                   kv_connector_worker_meta=w.build_connector_worker_meta())
        self.reports.append(w.get_kv_connector_stats())
        w.clear_connector_metadata()
        return sample_one_token(self.scheduler, output, kv_connector_output=report)

    def compute(self, output) -> None:
        """The forward pass's KV, where a test asks for it (ComputingEngine)."""

    def counted(self, key: str) -> float:
        return counted(self.reports, key)

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


@pytest.fixture
def engines(tmp_path):
    made = []

    def engine(role: str, **kwargs) -> Engine:
        made.append(Engine(role, f"fs://{tmp_path}", **kwargs))
        return made[-1]

    yield engine
    for e in made:
        e.close()


class ComputingEngine(Engine):
    """Plays the forward pass's KV too: the blocks a step computes get the prompt's true KV
    (true_kv), and blocks it retrieves keep what the retrieval put there."""

    def compute(self, output) -> None:
        for block, block_id in computed_blocks(self.scheduler, output):
            self.cache[block_id] = true_kv(block)


def true_kv(block: int) -> torch.Tensor:
    """What the model computes for a prompt's block `block` (every engine alike)."""
    return torch.rand(2, BLOCK_SIZE, 1, 1, generator=torch.Generator().manual_seed(1000 + block))


@pytest.fixture
def faults_allowed(monkeypatch):
    monkeypatch.setenv(ALLOWED_VAR, "1")
    monkeypatch.delenv(PRODUCTION_VAR, raising=False)


def test_a_clean_hand_off_is_verified_and_says_so(engines):
    prefill, decode = engines("kv_producer"), engines("kv_consumer")
    params = prefill_leg(prefill, PROMPT, "leg")
    assert kv_verdict_of(params) is None  # a prefill leg's answer carries no verdict
    (store,) = prefill.metas[0].stores
    stated = pd_section_of(params).kv_digest
    assert stated.algo == kv_digest.ALGO and stated.block_size == BLOCK_SIZE
    # the digests are of the prefill's own blocks of the prompt's full chunks
    assert list(kv_digest.decode(stated.ranks[0], 10)) == list(
        prefill.worker._worker.verifier.digests(store.block_ids))
    assert len(store.block_ids) == 2
    out = decode_leg(decode, PROMPT, params)
    assert kv_verdict_of(out.kv_transfer_params) == KvVerdict(
        verdict="verified", blocks=2, mismatched=0, transport="lmcache")
    (load,) = decode.metas[0].retrieves
    assert torch.equal(decode.cache[load.block_ids], prefill.cache[store.block_ids])
    assert decode.counted("kv_verified_blocks") == 2
    assert decode.counted("kv_mismatched_blocks") == 0
    assert decode.counted("kv_verdicts_verified") == 1


def test_after_a_local_prefix_hit_only_the_retrieved_blocks_are_checked(engines):
    prefill, decode = engines("kv_producer"), engines("kv_consumer")
    tokens = prompt(1, 56)  # three full chunks
    params = prefill_leg(prefill, tokens, "leg")
    decode_leg(decode, tokens[:20], None, req_id="warm")  # the decode computes block 0 itself
    out = decode_leg(decode, tokens, params, req_id="d2")
    (load,) = decode.metas[-1].retrieves
    assert load.skip_tokens == BLOCK_SIZE and len(load.expected) == 2
    assert kv_verdict_of(out.kv_transfer_params) == KvVerdict(
        verdict="verified", blocks=2, mismatched=0, transport="lmcache")


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("fault", ["stale_chunk", "corrupt"])
def test_a_stale_or_damaged_chunk_is_caught_and_never_used(engines, faults_allowed, fault,
                                                            policy):
    at_prefill = fault == "stale_chunk"
    spec = {"faults": f"{fault}:match=kvfault-"}
    prefill = engines("kv_producer", **(spec if at_prefill else {}))
    decode = engines("kv_consumer", failure_policy=policy, **({} if at_prefill else spec))
    tokens = prompt(2, 56)  # three full chunks: the fault hits one of them
    req_id = "cmpl-kvfault-1-0"
    params = prefill_leg(prefill, tokens, req_id)
    injector = prefill if at_prefill else decode
    out = decode_leg(decode, tokens, params, req_id=req_id)
    assert injector.counted("kv_faults_injected") == 1
    (load,) = decode.metas[0].retrieves
    bad = [i for i, b in enumerate(load.block_ids)
           if not torch.equal(decode.cache[b], prefill.cache[prefill.metas[0].stores[0]
                                                                .block_ids[i]])]
    verdict = kv_verdict_of(out.kv_transfer_params) if policy == "recompute" else None
    if policy == "recompute":
        assert verdict == KvVerdict(verdict="recomputed", blocks=3, mismatched=1,
                                    transport="lmcache")
        assert len(decode.metas) == 2  # the load step's output dropped, then recomputed
        assert decode.counted("kv_verdicts_recomputed") == 1
    else:
        from vllm.v1.engine import FinishReason

        assert out.finish_reason == FinishReason.ERROR and len(decode.metas) == 1
        assert decode.counted("kv_verdicts_failed") == 1
    assert decode.counted("kv_mismatched_requests") == 1
    assert decode.counted("kv_mismatched_blocks") == 1
    # the blocks before the bad one were good and kept; from it on, recomputed (not used)
    k = decode.counted("kv_verified_blocks")
    if policy == "recompute":
        assert k in (0, 1, 2)
        assert decode.metas[1].retrieves == []  # recomputed by the engine, not re-retrieved
    if not at_prefill:
        assert bad == [int(k)]  # `corrupt` damaged the block in the decode's cache
    # an untargeted request through the same engines is untouched and verified
    clean = prompt(3, 56)
    out = decode_leg(decode, clean, prefill_leg(prefill, clean, "cmpl-clean-0"), "cmpl-clean-0")
    assert kv_verdict_of(out.kv_transfer_params).verdict == "verified"
    assert injector.counted("kv_faults_injected") == 1


def test_twenty_of_each_fault_are_all_caught(engines, faults_allowed):
    prefill = engines("kv_producer", faults="stale_chunk:match=kvfault-")
    decode = engines("kv_consumer", faults="corrupt:match=kvfault-")
    verdicts = []
    for i in range(40):
        tokens = prompt(100 + i, 56)
        # the first 20 stale at the prefill, the next 20 damaged at the decode
        pre_id, dec_id = (f"kvfault-p{i}", f"clean-d{i}") if i < 20 else (f"clean-p{i}",
                                                                             f"kvfault-d{i}")
        params = prefill_leg(prefill, tokens, pre_id)
        verdicts.append(kv_verdict_of(decode_leg(decode, tokens, params, dec_id)
                                      .kv_transfer_params).verdict)
    assert prefill.counted("kv_faults_injected") == 20
    assert decode.counted("kv_faults_injected") == 20
    assert decode.counted("kv_mismatched_requests") == 40
    assert verdicts == ["recomputed"] * 40


def test_loads_without_digests_are_unverified_or_not_used_under_required(engines):
    prefill = engines("kv_producer", verify_kv="off")
    params = prefill_leg(prefill, PROMPT, "leg")
    assert pd_section_of(params).kv_digest is None
    decode = engines("kv_consumer")
    out = decode_leg(decode, PROMPT, params)
    assert kv_verdict_of(out.kv_transfer_params) == KvVerdict(
        verdict="unverified", blocks=2, mismatched=0, transport="lmcache")
    assert decode.counted("kv_unverified_loads") == 1
    # malformed digests are a client's value: unverified, never trusted
    other = prompt(4)
    params2 = prefill_leg(prefill, other, "leg2")
    section = dict(params2["pd"], kv_digest={"algo": kv_digest.ALGO, "block_size": BLOCK_SIZE,
                                              "ranks": ["not base64!"]})
    out = decode_leg(decode, other, {**params2, "pd": section}, req_id="d2")
    assert kv_verdict_of(out.kv_transfer_params).verdict == "unverified"
    strict = engines("kv_consumer", verify_kv="required")
    out = decode_leg(strict, PROMPT, params, req_id="d3")
    assert out.kv_transfer_params is None  # nothing loaded: computed, no verdict
    assert strict.metas[0].retrieves == []
    assert strict.counted("unverifiable_hits") == 1


def test_a_prefill_whose_retrieval_failed_never_stores_those_blocks(tmp_path):
    """A prefill finds the prompt in the pool, but its chunks are gone before the worker
    retrieves them: the load fails and vLLM recomputes. The blocks of that step are not the
    prompt's KV, so they must not be stored (nor digested); the recomputed ones are. A decode
    then retrieves the prompt's true KV, verified."""
    import os

    backend = f"fs://{tmp_path}"
    tokens = prompt(9, 56)  # three full chunks
    first, second = ComputingEngine("kv_producer", backend), ComputingEngine("kv_producer", backend)
    decode = ComputingEngine("kv_consumer", backend)
    try:
        prefill_leg(first, tokens, "first")
        assert os.listdir(tmp_path)

        def lose_the_chunks(meta) -> None:  # evicted, or the store cleaned up
            assert meta.retrieves
            for name in os.listdir(tmp_path):
                os.unlink(tmp_path / name)

        params = prefill_leg(second, tokens, "second", lose_the_chunks, steps=4)
        assert second.counted("failed_tokens") > 0  # the load did fail, and was recomputed
        out = decode_leg(decode, tokens, params)
        (load,) = decode.metas[0].retrieves
        for i, block in enumerate(load.block_ids[:3]):
            assert torch.equal(decode.cache[block], true_kv(i)), f"block {i}: not its KV"
        assert kv_verdict_of(out.kv_transfer_params).verdict == "verified"
    finally:
        for engine in (first, second, decode):
            engine.close()


def test_verify_off_digests_and_reports_nothing(engines):
    prefill = engines("kv_producer", verify_kv="off")
    decode = engines("kv_consumer", verify_kv="off")
    assert prefill.connector.digests is None and prefill.worker._worker.verifier is None
    out = decode_leg(decode, PROMPT, prefill_leg(prefill, PROMPT, "leg"))
    assert out.kv_transfer_params is None
    assert decode.counted("retrieved_tokens") == 32 and decode.counted("kv_verified_blocks") == 0

