"""The pool connectors' scheduler side (pool_scheduler.py) in vLLM's real scheduler, on CPU,
without a model or a server: what a prefill leg stores and answers, what a decode leg loads, the
last-token rule, `store: pd | all`, and malformed kv_transfer_params.

PdShmConnector runs on a real pool file; blocks "stored" by a prefill are published into it the
way its worker side would. PdLMCacheConnector's scheduler asks its worker's LMCache engine over a
socket; here a `FakeLMCacheLookups` (holding the leading tokens of some prompts) answers instead.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest

from pd_plugins.vocab.transfer_params import (
    STORED_TOKENS_KEY,
    PdSection,
    pd_section_of,
    prefill_flags,
)
from tests.unit.connectors.vllm_scheduler import (
    BLOCK_SIZE,
    make_request,
    make_scheduler,
    sample_one_token,
)

pytest.importorskip("vllm")

PROMPT = list(range(1, 41))  # 40 tokens: two full blocks of 16 and 8 tokens more
FULL = 2 * BLOCK_SIZE


def prompt(i: int, length: int = len(PROMPT)) -> list[int]:
    """A prompt of its own (no prefix shared with the test's other prompts)."""
    return [1000 + i] + PROMPT[1:length]


class FakeLMCacheLookups:
    """Stands in for the worker's LMCache engine behind PdLMCacheConnector's scheduler: holds
    the leading `tokens` of each prompt it was given (the LMCacheClient lookup signature)."""

    def __init__(self) -> None:
        self.held: list[tuple[list[int], int]] = []
        self.asked: list[str] = []

    def lookup(self, tokens, namespace: str = "") -> int:
        self.asked.append(namespace)
        return max((held for prefix, held in self.held if list(tokens[:held]) == prefix[:held]),
                   default=0)

    def close(self) -> None:
        pass


class Shm:
    connector = "PdShmConnector"
    mode = "shm"

    def __init__(self, tmp_path) -> None:
        self.path = str(tmp_path / "pool")

    def scheduler(self, role: str, **options: Any):
        return make_scheduler(self.connector, role, {
            "pool_path": self.path, "pool_size_gb": 0.01, "remove_when_unused": True, **options},
            engine_id=f"shm-{uuid.uuid4().hex[:8]}")

    def put(self, scheduler, request, blocks: int) -> dict[str, Any]:
        """Publish the request's first blocks as a prefill's worker side would; returns what
        that prefill answers about them."""
        from pd_plugins.connectors.vllm.pd_shm import pool_key

        pool = scheduler.connector.pool
        refs = pool.reserve([pool_key(h, 0) for h in request.block_hashes[:blocks]])
        row = np.zeros(pool.slot_bytes, np.uint8)
        assert all(pool.publish([(r, pool.write(r, row), pool.slot_bytes) for r in refs],
                                hold_s=60))
        return {"pool_id": pool.pool_id, "pool_slots": [[r.slot, r.seq] for r in refs]}

    def loaded_blocks(self, meta, request) -> list[int]:
        (op,) = [op for op in meta.loads if op.req_id == request.request_id]
        assert op.block_hashes == request.block_hashes[:len(op.block_ids)]
        return op.block_ids

    def stored_blocks(self, meta, request) -> list[int]:
        ops = [op for op in meta.stores if op.req_id == request.request_id]
        blocks = [b for op in ops for b in op.block_ids]
        assert [h for op in ops for h in op.block_hashes] == request.block_hashes[:len(blocks)]
        return blocks

    def check_answer(self, scheduler, params: dict[str, Any], request) -> None:
        pool = scheduler.connector.pool
        assert params["pool_id"] == pool.pool_id
        from pd_plugins.connectors.vllm.pd_shm import pool_key

        refs = pool.lookup([pool_key(h, 0) for h in request.block_hashes])
        assert params["pool_slots"] == [[r.slot, r.seq] if r else None for r in refs]


class LMCache:
    connector = "PdLMCacheConnector"
    mode = "lmcache"

    def __init__(self, tmp_path) -> None:
        self.backend = f"fs://{tmp_path}"
        self.lookups = FakeLMCacheLookups()  # one backend, shared by the test's engines

    def scheduler(self, role: str, **options: Any):
        pytest.importorskip("lmcache")
        scheduler = make_scheduler(self.connector, role, {"backend": self.backend, **options},
                                   engine_id=f"lmc-{uuid.uuid4().hex[:8]}")
        connector = scheduler.connector
        connector.lookups.close()  # the real lookup channel: no worker behind it here
        connector.lookups = self.lookups
        return scheduler

    def put(self, scheduler, request, blocks: int) -> dict[str, Any]:
        tokens = blocks * BLOCK_SIZE
        scheduler.connector.lookups.held.append((list(request.prompt_token_ids), tokens))
        return {STORED_TOKENS_KEY: tokens}

    def loaded_blocks(self, meta, request) -> list[int]:
        (op,) = [op for op in meta.retrieves if op.req_id == request.request_id]
        assert op.tokens == request.prompt_token_ids[:len(op.block_ids) * BLOCK_SIZE]
        return op.block_ids

    def stored_blocks(self, meta, request) -> list[int]:
        ops = [op for op in meta.stores if op.req_id == request.request_id]
        blocks = [b for op in ops for b in op.block_ids]
        assert [t for op in ops for t in op.tokens] == request.prompt_token_ids[:len(blocks)
                                                                                * BLOCK_SIZE]
        return blocks

    def check_answer(self, scheduler, params: dict[str, Any], request) -> None:
        assert params[STORED_TOKENS_KEY] == FULL  # what the store op above covered


@pytest.fixture(params=[Shm, LMCache], ids=["shm", "lmcache"])
def pool(request, tmp_path):
    return request.param(tmp_path)


@pytest.fixture
def schedulers():
    made = []
    yield made
    for scheduler in made:
        scheduler.shutdown()


def open_scheduler(pool, schedulers, role: str, **options: Any):
    scheduler = pool.scheduler(role, **options)
    schedulers.append(scheduler)
    return scheduler


def own_blocks(scheduler, request) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(request.request_id)[0])


def test_prefill_leg_stores_its_full_blocks_and_answers_a_pd_section(pool, schedulers):
    scheduler = open_scheduler(pool, schedulers, "kv_producer")
    leg = make_request("leg", PROMPT, {"kv_transfer_params": prefill_flags()}, max_tokens=1)
    scheduler.add_request(leg)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"leg": len(PROMPT)}
    assert pool.stored_blocks(output.kv_connector_metadata, leg) == own_blocks(scheduler, leg)[:2]
    finished = sample_one_token(scheduler, output)
    params = finished["leg"].kv_transfer_params
    engine_id = scheduler.connector.engine_id
    assert {k: params[k] for k in ("do_remote_prefill", "do_remote_decode", "remote_engine_id",
                                   "remote_request_id")} == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
        "remote_request_id": "leg"}
    assert pd_section_of(params) == PdSection(prompt_tokens=len(PROMPT), cached_tokens=0,
                                              engine_id=engine_id, mode=pool.mode,
                                              block_size=BLOCK_SIZE)
    pool.check_answer(scheduler, params, leg)


def test_prefill_answer_counts_the_prompt_tokens_found_in_the_pool(pool, schedulers):
    scheduler = open_scheduler(pool, schedulers, "kv_producer")
    leg = make_request("leg", PROMPT, {"kv_transfer_params": prefill_flags()}, max_tokens=1)
    pool.put(scheduler, leg, blocks=2)  # an earlier prefill of the same prefix
    scheduler.add_request(leg)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"leg": len(PROMPT) - FULL}
    params = sample_one_token(scheduler, output)["leg"].kv_transfer_params
    assert pd_section_of(params).cached_tokens == FULL


def test_decode_leg_loads_the_prompt_blocks_its_prefill_stored(pool, schedulers):
    prefill = open_scheduler(pool, schedulers, "kv_producer")
    decode = open_scheduler(pool, schedulers, "kv_consumer")
    leg = make_request("d", PROMPT)
    answer = pool.put(prefill, leg, blocks=2)
    leg = make_request("d", PROMPT, {"kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p",
        "remote_request_id": "p-1", **answer}})
    decode.add_request(leg)
    output = decode.schedule()
    assert output.num_scheduled_tokens == {"d": len(PROMPT) - FULL}  # the rest is loaded
    assert output.scheduled_new_reqs[0].num_computed_tokens == FULL
    assert pool.loaded_blocks(output.kv_connector_metadata, leg) == own_blocks(decode, leg)[:2]
    assert not output.kv_connector_metadata.stores  # a consumer stores nothing
    finished = sample_one_token(decode, output)
    assert finished == {} or finished["d"].kv_transfer_params is None  # no answer from a decode


def test_decode_leg_loads_only_what_the_pool_still_has(pool, schedulers):
    prefill = open_scheduler(pool, schedulers, "kv_producer")
    decode = open_scheduler(pool, schedulers, "kv_consumer")
    leg = make_request("d", PROMPT)
    answer = pool.put(prefill, leg, blocks=1)  # the second block was evicted meanwhile
    if "pool_slots" in answer:
        answer["pool_slots"].append([0, 0])
    else:
        answer[STORED_TOKENS_KEY] = FULL
    leg = make_request("d", PROMPT, {"kv_transfer_params": {"do_remote_prefill": True,
                                                            **answer}})
    decode.add_request(leg)
    output = decode.schedule()
    assert output.num_scheduled_tokens == {"d": len(PROMPT) - BLOCK_SIZE}
    assert pool.loaded_blocks(output.kv_connector_metadata, leg) == own_blocks(decode, leg)[:1]


def test_the_engine_computes_the_last_prompt_token_itself(pool, schedulers):
    """A prompt wholly in the pool: all but its last token are loaded (vLLM needs one token to
    compute to sample from); the load still covers the last block."""
    prefill = open_scheduler(pool, schedulers, "kv_producer")
    decode = open_scheduler(pool, schedulers, "kv_consumer")
    exact = PROMPT[:FULL]
    pool.put(prefill, make_request("x", exact), blocks=2)
    leg = make_request("d", exact, {"kv_transfer_params": {"do_remote_prefill": True}})
    decode.add_request(leg)
    output = decode.schedule()
    assert output.num_scheduled_tokens == {"d": 1}
    assert output.scheduled_new_reqs[0].num_computed_tokens == FULL - 1
    assert pool.loaded_blocks(output.kv_connector_metadata, leg) == own_blocks(decode, leg)[:2]


@pytest.mark.parametrize("store", ["pd", "all"])
def test_store_pd_stores_prefill_legs_only_and_all_every_request(pool, schedulers, store):
    scheduler = open_scheduler(pool, schedulers, "kv_both", store=store)
    leg = make_request("leg", prompt(1), {"kv_transfer_params": prefill_flags()}, max_tokens=1)
    plain = make_request("plain", prompt(2), max_tokens=1)
    scheduler.add_request(leg)
    scheduler.add_request(plain)
    output = scheduler.schedule()
    meta = output.kv_connector_metadata
    assert pool.stored_blocks(meta, leg) == own_blocks(scheduler, leg)[:2]
    assert pool.stored_blocks(meta, plain) == (own_blocks(scheduler, plain)[:2]
                                               if store == "all" else [])
    finished = sample_one_token(scheduler, output)
    assert pd_section_of(finished["leg"].kv_transfer_params) is not None
    assert finished["plain"].kv_transfer_params is None  # only a prefill leg answers


def test_a_chunked_prefill_stores_each_step_s_new_full_blocks(schedulers, tmp_path):
    """PdShmConnector writes blocks as they are computed (LMCache stores after the prompt)."""
    shm = Shm(tmp_path)
    scheduler = open_scheduler(shm, schedulers, "kv_producer")
    scheduler.max_num_scheduled_tokens = 24  # a chunk and a half: 16 + 8, then the rest
    leg = make_request("leg", PROMPT, {"kv_transfer_params": prefill_flags()}, max_tokens=1)
    scheduler.add_request(leg)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"leg": 24}
    assert shm.stored_blocks(first.kv_connector_metadata, leg) == own_blocks(scheduler, leg)[:1]
    sample_one_token(scheduler, first)
    second = scheduler.schedule()
    (op,) = second.kv_connector_metadata.stores
    assert op.block_ids == own_blocks(scheduler, leg)[1:2]
    assert op.block_hashes == leg.block_hashes[1:2]


def test_malformed_transfer_params_are_served_locally_and_neither_stored_nor_answered(
        pool, schedulers):
    from pd_plugins.connectors.vllm.counter_stats import REJECTED_PARAMS_KEY

    scheduler = open_scheduler(pool, schedulers, "kv_both")
    bad = make_request("bad", prompt(3), {"kv_transfer_params": "do_remote_decode"},
                       max_tokens=1)
    scheduler.add_request(bad)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"bad": len(PROMPT)}
    assert bad.kv_transfer_params is None
    assert sum(scheduler.connector.get_kv_connector_stats().data[REJECTED_PARAMS_KEY]) == 1
    assert pool.stored_blocks(output.kv_connector_metadata, bad) == []  # not a PD leg
    assert sample_one_token(scheduler, output)["bad"].kv_transfer_params is None


def test_garbage_transport_fields_from_a_client_load_only_what_the_pool_has(pool, schedulers):
    """A decode leg's transport fields are hints at most: wrong types load what the engine's
    own lookup finds, and nothing crashes."""
    prefill = open_scheduler(pool, schedulers, "kv_producer")
    decode = open_scheduler(pool, schedulers, "kv_consumer")
    leg = make_request("d", PROMPT)
    pool.put(prefill, leg, blocks=1)
    garbage = {"do_remote_prefill": True, "pool_id": 5, "pool_slots": "all of them",
               STORED_TOKENS_KEY: "many"}
    leg = make_request("d", PROMPT, {"kv_transfer_params": garbage})
    decode.add_request(leg)
    output = decode.schedule()
    assert output.num_scheduled_tokens == {"d": len(PROMPT) - BLOCK_SIZE}
    assert pool.loaded_blocks(output.kv_connector_metadata, leg) == own_blocks(decode, leg)[:1]


def test_slot_hints_outside_the_pools_integer_range_are_dropped():
    from pd_plugins.connectors.vllm.pd_shm import _slot_hints
    from pd_plugins.transfer.shm_pool import SlotRef
    params = {"pool_id": "p", "pool_slots": [[1 << 63, 1], [3, 1 << 64], [-1, 0], [3, 4]]}
    assert _slot_hints(params, "p", 0, 4) == [None, None, None, SlotRef(3, 4)]


def test_a_store_keeps_only_the_blocks_before_any_failed_load_of_the_step():
    """PoolWorkerSide.own_blocks: a request's store stops at the first block whose load failed
    in this step, whichever request loaded it (vLLM lets a request of the same step share a block
    another is loading); a request whose own load failed before its store's blocks keeps none."""
    from pd_plugins.connectors.vllm.pool_connector import PoolWorkerSide

    worker = PoolWorkerSide()
    assert worker.own_blocks("a", [3, 5, 7]) == 3  # no failed load: all
    worker.fail_blocks("a", [5])
    assert worker.own_blocks("a", [3, 5, 7]) == 1
    assert worker.own_blocks("b", [2, 3, 5, 9]) == 2  # b shares a's block 5
    assert worker.own_blocks("b", [10, 11]) == 2  # nothing of a's
    assert worker.own_blocks("a", [8, 9]) == 0  # computed after a's failed block
    assert worker.take_load_errors() == {5}
    worker.end_step()
    assert worker.own_blocks("a", [3, 5, 7]) == 3  # the next step stores what it recomputed
