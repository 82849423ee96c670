"""PdShmConnector's verified hand-off (issue 28) in vLLM's real scheduler on CPU, with the
connector's real worker side copying real KV tensors through a real pool file: a prefill's
blocks go into the pool, a decode loads them, and its answer says what it found (`pd.kv`).
A slot damaged in the pool (`flip_slot`, injected by the prefill's worker) is caught by the
decode, never used, dropped from the pool, recomputed (or failed, per kv_load_failure_policy),
and counted on both sides. Only the forward pass is missing: the test plays the model runner
(vllm_scheduler.sample_one_token)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from pd_plugins.transfer.kv_faults import ALLOWED_VAR, PRODUCTION_VAR
from pd_plugins.transfer.options import OptionError
from pd_plugins.vocab.transfer_params import KvVerdict, kv_verdict_of, prefill_flags
from tests.unit.connectors.vllm_scheduler import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    computed_blocks,
    counted,
    decode_leg,
    keep_scheduler_stats,
    prefill_leg,
    make_request,
    make_scheduler,
    sample_one_token,
)

pytest.importorskip("vllm")

PROMPT = list(range(1, 41))  # 40 tokens: two full blocks of 16 and 8 tokens more
LAYER = "model.layers.0.self_attn.attn"  # vllm_scheduler's one layer


class Engine:
    """One engine: vLLM's scheduler with PdShmConnector, and the connector's worker side over
    a KV cache tensor of its own."""

    def __init__(self, role: str, path: str, failure_policy: str = "recompute", **extra) -> None:
        from pd_plugins.connectors.vllm.pd_shm import _WorkerSide
        from pd_plugins.transfer.paged_kv import PagedKV

        self.scheduler = make_scheduler(
            "PdShmConnector", role,
            {"pool_path": path, "pool_size_gb": 0.01, "remove_when_unused": True, **extra},
            engine_id=f"shm-{uuid.uuid4().hex[:8]}", failure_policy=failure_policy)
        self.connector = self.scheduler.connector
        # the worker side runs in the worker process; here it shares the scheduler's connector
        # (pool, options, faults) as a stand-in for the worker's own instance
        self.worker = _WorkerSide(self.connector)
        words = self.connector.slot_bytes // 4
        seed = int.from_bytes(uuid.uuid4().bytes[:4], "little")
        self.cache = torch.from_numpy(np.random.default_rng(seed).standard_normal(
            (NUM_BLOCKS, words)).astype(np.float32))
        self.worker.kv = PagedKV([self.cache], NUM_BLOCKS)
        self.worker._layer_index = {LAYER: 0}
        self.worker_stats: list = []
        self.scheduler_stats: list = []
        self.metas: list = []
        keep_scheduler_stats(self.connector, self.scheduler_stats)

    def step(self, before_worker=None) -> dict:
        """One engine step: schedule, the worker's loads and stores, the model's one token.
        `before_worker(meta)`: what happens elsewhere between the schedule and the worker."""
        from vllm.v1.outputs import KVConnectorOutput

        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        self.metas.append(meta)
        if before_worker is not None:
            before_worker(meta)
        self.worker.begin_step(meta)
        self.worker.start_load_kv(meta)
        self.compute(output)
        self.worker.save_kv_layer(LAYER)
        self.worker.wait_for_save(meta)
        report = KVConnectorOutput(invalid_block_ids=self.worker.take_load_errors(),
                                   kv_connector_worker_meta=self.worker.take_outcomes())
        self.worker_stats.append(self.worker.take_stats())
        return sample_one_token(self.scheduler, output, kv_connector_output=report)

    def compute(self, output) -> None:
        """The forward pass's KV, where a test asks for it (ComputingEngine)."""

    def counted(self, key: str) -> float:
        return counted([*self.worker_stats, *self.scheduler_stats], key)

    def close(self) -> None:
        self.scheduler.shutdown()


def true_kv(block: int, words: int) -> torch.Tensor:
    """What the model computes for a prompt's block `block` (every engine alike)."""
    return torch.from_numpy(np.random.default_rng(1000 + block).standard_normal(words)
                            .astype(np.float32))


class ComputingEngine(Engine):
    """Plays the forward pass's KV too: the blocks a step computes get the prompt's true KV
    (true_kv), and blocks it loads keep what the load put there."""

    def compute(self, output) -> None:
        for block, block_id in computed_blocks(self.scheduler, output):
            self.cache[block_id] = true_kv(block, self.cache.shape[1])


@pytest.fixture
def engines(tmp_path):
    made = []

    def engine(role: str, **kwargs) -> Engine:
        made.append(Engine(role, str(tmp_path / "pool"), **kwargs))
        return made[-1]

    yield engine
    for e in made:
        e.close()


def test_a_clean_hand_off_is_verified_and_says_so(engines):
    prefill, decode = engines("kv_producer"), engines("kv_consumer")
    assert prefill.connector.pool.checksums  # verify_kv on by default: a new pool sums
    params = prefill_leg(prefill, PROMPT, "leg")
    assert kv_verdict_of(params) is None  # a prefill answer carries no verdict of its own
    out = decode_leg(decode, PROMPT, params)
    assert kv_verdict_of(out.kv_transfer_params) == KvVerdict(
        verdict="verified", blocks=2, mismatched=0, transport="shm")
    # what landed in the decode's cache is the prefill's KV
    (store,) = prefill.metas[0].stores
    (load,) = decode.metas[0].loads
    assert torch.equal(decode.cache[load.block_ids], prefill.cache[store.block_ids])
    assert decode.counted("kv_verified_blocks") == 2
    assert decode.counted("kv_mismatched_blocks") == 0
    assert decode.counted("kv_verdicts_verified") == 1


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_flipped_slot_is_caught_dropped_and_never_used(engines, monkeypatch, policy):
    monkeypatch.setenv(ALLOWED_VAR, "1")
    monkeypatch.delenv(PRODUCTION_VAR, raising=False)
    prefill = engines("kv_producer", faults="flip_slot:match=kvfault-")
    decode = engines("kv_consumer", failure_policy=policy)
    clean = prefill_leg(prefill, [500] + PROMPT[1:], "cmpl-clean-0")  # not targeted
    params = prefill_leg(prefill, PROMPT, "cmpl-kvfault-1-0")
    assert prefill.counted("kv_faults_injected") == 1
    pool = decode.connector.pool
    from pd_plugins.connectors.vllm.pd_shm import pool_key

    request = make_request("probe", PROMPT)
    assert all(pool.lookup([pool_key(h, 0) for h in request.block_hashes[:2]]))

    out = decode_leg(decode, PROMPT, params, req_id="cmpl-kvfault-1-0")
    verdict = kv_verdict_of(out.kv_transfer_params)
    if policy == "recompute":
        assert verdict == KvVerdict(verdict="recomputed", blocks=2, mismatched=1,
                                    transport="shm")
        assert decode.counted("kv_verdicts_recomputed") == 1
        assert len(decode.metas) == 2  # the load step's output dropped, then recomputed
    else:
        from vllm.v1.engine import FinishReason

        assert out.finish_reason == FinishReason.ERROR and len(decode.metas) == 1
        assert decode.counted("kv_verdicts_failed") == 1
    assert decode.counted("kv_mismatched_blocks") == 1
    assert decode.counted("kv_mismatched_requests") == 1
    assert decode.counted("kv_verified_blocks") == 1  # the other block was good
    # the bad slot is gone from the pool: no later request loads it
    assert decode.counted("discarded_blocks") == 1
    assert sum(r is None for r in pool.lookup([pool_key(h, 0)
                                               for h in request.block_hashes[:2]])) == 1
    # an untargeted request is untouched and verified
    assert kv_verdict_of(decode_leg(decode, [500] + PROMPT[1:], clean, "cmpl-clean-0")
                         .kv_transfer_params).verdict == "verified"
    assert prefill.counted("kv_faults_injected") == 1


@pytest.mark.parametrize("kind", ["flip_slot", "reuse"])
def test_fifty_injected_faults_are_all_detected(engines, monkeypatch, kind):
    """`flip_slot` on the prefill, caught by the checksum (a mismatched block); `reuse` on the
    decode, caught by the generation (a failed block, no mismatch)."""
    monkeypatch.setenv(ALLOWED_VAR, "1")
    monkeypatch.delenv(PRODUCTION_VAR, raising=False)
    faults = {"faults": f"{kind}:match=kvfault-"}
    prefill = engines("kv_producer", **(faults if kind == "flip_slot" else {}))
    decode = engines("kv_consumer", **(faults if kind == "reuse" else {}))
    injector = prefill if kind == "flip_slot" else decode
    verdicts = []
    for i in range(50):
        prompt = [2000 + i] + PROMPT[1:]
        params = prefill_leg(prefill, prompt, f"cmpl-kvfault-{i}-0")
        out = decode_leg(decode, prompt, params, req_id=f"cmpl-kvfault-{i}-0")
        verdicts.append(kv_verdict_of(out.kv_transfer_params).verdict)
    assert injector.counted("kv_faults_injected") == 50 == decode.counted("failed_blocks")
    assert decode.counted("kv_mismatched_blocks") == (50 if kind == "flip_slot" else 0)
    assert verdicts == ["recomputed"] * 50


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_slot_reused_between_pin_and_copy_is_never_used(engines, monkeypatch, policy):
    """`reuse` on the decode: a pinned slot gets a new generation before the copy, as a reuse
    would; the generation check (unpin) catches it, the block is recomputed (or the request
    fails), and it is no checksum mismatch: the slot's bytes are whatever the reuse left."""
    monkeypatch.setenv(ALLOWED_VAR, "1")
    monkeypatch.delenv(PRODUCTION_VAR, raising=False)
    prefill = engines("kv_producer")
    decode = engines("kv_consumer", failure_policy=policy, faults="reuse:match=kvfault-")
    clean = prefill_leg(prefill, [600] + PROMPT[1:], "cmpl-clean-0")
    params = prefill_leg(prefill, PROMPT, "cmpl-kvfault-2-0")
    out = decode_leg(decode, PROMPT, params, req_id="cmpl-kvfault-2-0")
    assert decode.counted("kv_faults_injected") == 1
    verdict = kv_verdict_of(out.kv_transfer_params)
    if policy == "recompute":
        assert verdict == KvVerdict(verdict="recomputed", blocks=2, mismatched=0,
                                    transport="shm")
        assert len(decode.metas) == 2  # the load step's output dropped, then recomputed
    else:
        from vllm.v1.engine import FinishReason

        assert out.finish_reason == FinishReason.ERROR
        assert decode.counted("kv_verdicts_failed") == 1
    assert decode.counted("failed_blocks") == 1 and decode.counted("kv_mismatched_blocks") == 0
    assert decode.counted("discarded_blocks") == 0  # a torn copy says nothing about the slot
    assert kv_verdict_of(decode_leg(decode, [600] + PROMPT[1:], clean, "cmpl-clean-0")
                         .kv_transfer_params).verdict == "verified"
    assert decode.counted("kv_faults_injected") == 1


@pytest.mark.parametrize("save_mode", ["layer", "step"])
def test_a_prefill_whose_pool_load_failed_never_republishes_those_blocks(tmp_path, save_mode):
    """A prefill finds the prompt in the pool, but its slots are evicted between the scheduler's
    lookup and the worker's pin: the load fails and vLLM recomputes. The blocks of that step are
    not the prompt's KV (stale cache bytes), so they must not be stored with fresh checksums; the
    recomputed ones are. A decode then loads the prompt's true KV, verified."""
    from pd_plugins.connectors.vllm.pd_shm import pool_key

    path = str(tmp_path / "pool")
    first = ComputingEngine("kv_producer", path, save_mode=save_mode)
    second = ComputingEngine("kv_producer", path, save_mode=save_mode)
    decode = ComputingEngine("kv_consumer", path)
    try:
        prefill_leg(first, PROMPT, "first")  # the prompt's true KV into the pool
        pool = first.connector.pool
        words = first.cache.shape[1]

        def evict(meta) -> None:  # another engine's writes evict the slots; played by dropping
            (load,) = meta.loads
            pinned = pool.pin([pool_key(h, 0) for h in load.block_hashes])
            pool.unpin(pinned)
            assert pool.discard(pinned) == 2

        params = prefill_leg(second, PROMPT, "second", evict, steps=4)
        assert second.counted("failed_blocks") == 2  # the load did fail, and was recomputed
        out = decode_leg(decode, PROMPT, params)
        (load,) = decode.metas[0].loads
        for i, block in enumerate(load.block_ids):
            assert torch.equal(decode.cache[block], true_kv(i, words)), f"block {i}: not its KV"
        assert kv_verdict_of(out.kv_transfer_params).verdict == "verified"
    finally:
        for engine in (first, second, decode):
            engine.close()


def test_verify_off_reports_nothing(engines):
    prefill, decode = engines("kv_producer"), engines("kv_consumer", verify_kv="off")
    params = prefill_leg(prefill, PROMPT, "leg")
    out = decode_leg(decode, PROMPT, params)
    assert out.kv_transfer_params is None
    assert decode.counted("kv_verified_blocks") == 0 and decode.counted("loaded_blocks") == 2


def test_a_pool_without_checksums_loads_unverified_or_is_refused(engines):
    prefill = engines("kv_producer", checksums=False)
    assert not prefill.connector.pool.checksums
    decode = engines("kv_consumer")  # follows the pool: no checksums to check
    out = decode_leg(decode, PROMPT, prefill_leg(prefill, PROMPT, "leg"))
    assert kv_verdict_of(out.kv_transfer_params) == KvVerdict(
        verdict="unverified", blocks=2, mismatched=0, transport="shm")
    assert decode.counted("kv_unverified_loads") == 1
    from pd_plugins.transfer.shm_pool import PoolError

    with pytest.raises(PoolError, match="has no checksums.*required"):
        engines("kv_consumer", verify_kv="required")


def test_faults_are_refused_without_permission(engines, monkeypatch):
    monkeypatch.delenv(ALLOWED_VAR, raising=False)
    with pytest.raises(OptionError, match=f"needs {ALLOWED_VAR}=1"):
        engines("kv_producer", faults="flip_slot")
    monkeypatch.setenv(ALLOWED_VAR, "1")
    monkeypatch.setenv(PRODUCTION_VAR, "1")
    with pytest.raises(OptionError, match=f"{PRODUCTION_VAR} is set"):
        engines("kv_producer", faults="flip_slot")


def test_blocks_a_prefill_found_in_the_pool_are_held_for_its_decode(engines):
    """`hold_s` keeps a prefill's blocks for its decode: those it found already published too
    (their own hold long over), not only those it wrote."""
    from pd_plugins.connectors.vllm.pd_shm import pool_key

    earlier = engines("kv_producer", hold_s=0)
    prefill_leg(earlier, PROMPT, "earlier")  # stored long ago: no hold left
    prefill = engines("kv_producer", hold_s=60)
    found = prefill_leg(prefill, PROMPT, "found")  # present: nothing written by this leg
    fresh = [1000 + t for t in PROMPT]
    prefill_leg(prefill, fresh, "fresh")  # written by this leg
    pool = prefill.connector.pool
    filler = [bytes([i % 256, i // 256]) * 16 for i in range(pool.num_slots)]
    pool.publish([(r, 0, 0) for r in pool.reserve(filler) if r is not None])  # other traffic
    for prompt in (PROMPT, fresh):
        keys = [pool_key(h, 0) for h in make_request("x", prompt).block_hashes]
        assert pool.count_prefix(keys) == 2, "a held block was evicted before its decode"
    assert found["pool_slots"] and all(found["pool_slots"])


def test_blocks_another_leg_is_writing_are_not_counted_unstored(engines):
    """Two PD legs of one prompt in one step: the second finds the first's blocks being written
    (it publishes them), which is not a full pool."""
    prefill = engines("kv_producer")
    for req_id in ("one", "two"):
        prefill.scheduler.add_request(make_request(
            req_id, PROMPT, {"kv_transfer_params": prefill_flags()}, max_tokens=1))
    finished = prefill.step()
    assert {"one", "two"} <= finished.keys()
    assert prefill.counted("stored_blocks") == 2 and prefill.counted("present_blocks") == 2
    assert prefill.counted("unstored_blocks") == 0
