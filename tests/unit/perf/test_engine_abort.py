"""EngineInstance.abort: a request whose client left frees its place in the queue, the batch and
the KV cache at once, also in the middle of a step."""

import pytest

from pd_plugins.perf.engine_model import EngineInstance, EngineRequest
from pd_plugins.perf.hardware import preset

HW = preset("llama-3.1-8b@h100")


def drive(inst: EngineInstance, now: float = 0.0):
    while (d := inst.plan(now)) is not None:
        now += d
        inst.finish(now)
    return now


def all_unpinned(inst: EngineInstance) -> bool:
    return inst.cache.private_blocks == 0 and inst.cache.evictable_blocks() == inst.cache.cached_blocks


def test_abort_a_queued_request_lets_the_next_one_in():
    inst = EngineInstance(HW, block_size=16, kv_capacity_tokens=16 * 10)
    a, b = EngineRequest("a", 100, 20, []), EngineRequest("b", 100, 20, [])
    inst.submit(a, 0.0)
    inst.submit(b, 0.0)
    inst.plan(0.0)  # a admitted; b waits for KV
    assert inst.num_waiting == 1
    assert inst.abort(b, 0.0) and b.error == "aborted"
    assert inst.num_waiting == 0
    inst.finish(0.01)
    drive(inst, 0.01)
    assert a.finished_at is not None and b.first_token_at is None


def test_abort_during_a_prefill_step_frees_its_blocks_and_reports_nothing():
    inst = EngineInstance(HW, block_size=16)
    req = EngineRequest("a", 1000, 10, list(range(62)))
    inst.submit(req, 0.0)
    d = inst.plan(0.0)
    assert inst.abort(req, d / 2)
    result = inst.finish(d)
    assert result.first_tokens == [] and result.finished == []
    assert inst.num_running == 0 and inst.plan(d) is None
    assert all_unpinned(inst) and inst.cache.cached_blocks == 62  # still a cached prefix


def test_abort_mid_decode_restores_the_batch():
    inst = EngineInstance(HW, block_size=16)
    a, b = EngineRequest("a", 100, 50, []), EngineRequest("b", 300, 50, [])
    inst.submit(a, 0.0)
    inst.submit(b, 0.0)
    now = 0.0
    for _ in range(10):
        now += inst.plan(now)
        inst.finish(now)
    assert a.first_token_at is not None and b.first_token_at is not None
    assert inst.abort(b, now)
    made = 10 - 1  # a's tokens after its first, one per step
    d = inst.plan(now)  # a alone now: its context is its prompt plus what it has made
    assert d == pytest.approx(HW.decode_step_s(1, 100 + 1 + made))
    inst.finish(now + d)
    drive(inst, now + d)
    assert a.finished_at is not None and b.finished_at == now
    assert inst._decode_kv_tokens == 0 and all_unpinned(inst)


def test_abort_a_remote_decode_joining_in_the_step_in_flight():
    inst = EngineInstance(HW, block_size=16)
    req = EngineRequest("d", 64, 5, [1, 2, 3, 4], kind="remote_decode")
    inst.submit(req, 0.0)
    wait = inst.plan(0.0)  # admitted, loading its KV
    inst.finish(wait)
    d = inst.plan(wait)  # joins the batch: its first token ends this step
    assert inst.abort(req, wait + d / 2)
    result = inst.finish(wait + d)
    assert result.first_tokens == [] and inst.num_running == 0
    assert inst._decode_kv_tokens == 0 and all_unpinned(inst)


def test_abort_after_the_end_changes_nothing():
    inst = EngineInstance(HW, block_size=16)
    leg = EngineRequest("p", 64, 1, [1, 2, 3, 4], kind="prefill")
    inst.submit(leg, 0.0)
    drive(inst)
    assert not inst.abort(leg, 1.0)
    assert inst.cache.private_blocks == 1  # still pinned for the decode: release() frees it
    inst.release(leg)
    assert all_unpinned(inst)
