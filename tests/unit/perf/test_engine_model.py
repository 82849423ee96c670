"""The engine model, step by step, against times computed by hand from the roofline."""

import pytest

from pd_plugins.perf.engine_model import EngineInstance, EngineRequest
from pd_plugins.perf.hardware import preset

HW = preset("llama-3.1-8b@h100")


def run(inst: EngineInstance, now: float = 0.0, until=lambda: False):
    """Drive an instance alone until it is idle; returns every StepResult with its end time."""
    out = []
    while not until():
        d = inst.plan(now)
        if d is None:
            break
        now += d
        out.append((now, inst.finish(now)))
    return out


def test_local_request_ttft_and_decode_steps_by_hand():
    inst = EngineInstance(HW, block_size=16)
    req = EngineRequest("a", prompt_tokens=100, output_tokens=4, block_keys=list(range(6)))
    inst.submit(req, 0.0)
    run(inst)
    ttft = HW.prefill_s(100)
    assert req.first_token_at == pytest.approx(ttft)
    # three decode steps, the context growing by one token each
    steps = sum(HW.decode_step_s(1, 101 + i) for i in range(3))
    assert req.finished_at == pytest.approx(ttft + steps)
    assert inst.cache.used_blocks == 6  # the full blocks stay cached, the private ones are freed


def test_long_prompt_is_chunked_by_the_token_budget():
    inst = EngineInstance(HW, block_size=16, max_batched_tokens=8192)
    req = EngineRequest("a", 10_000, 1, [])
    inst.submit(req, 0.0)
    run(inst)
    assert req.first_token_at == pytest.approx(HW.step_s([(8192, 0)]) + HW.step_s([(1808, 8192)]))


def test_prefix_cache_hit_skips_the_cached_blocks():
    inst = EngineInstance(HW, block_size=16)
    first = EngineRequest("a", 320, 1, list(range(20)))
    inst.submit(first, 0.0)
    run(inst)
    second = EngineRequest("b", 330, 1, list(range(20)))  # same 20 blocks, 10 more tokens
    inst.submit(second, 1.0)
    run(inst, 1.0)
    assert second.cached_tokens == 320
    assert second.first_token_at - 1.0 == pytest.approx(HW.step_s([(10, 320)]))
    assert inst.prompt_tokens_cached == 320 and inst.prefill_tokens_computed == 320 + 10
    whole = EngineRequest("c", 320, 1, list(range(20)))
    inst.submit(whole, 2.0)
    run(inst, 2.0)
    assert whole.cached_tokens == 319  # the last token is always recomputed


def test_decodes_share_steps_with_prefill_chunks():
    inst = EngineInstance(HW, block_size=16)
    a = EngineRequest("a", 100, 50, [])
    inst.submit(a, 0.0)
    run(inst, until=lambda: a.first_token_at is not None)
    now = a.first_token_at
    b = EngineRequest("b", 2000, 2, [])
    inst.submit(b, now)
    d = inst.plan(now)
    # one step: b's whole prefill plus a's decode token
    assert d == pytest.approx(HW.step_s([(2000, 0)], decode_batch=1, decode_kv_tokens=101))
    inst.finish(now + d)
    assert b.first_token_at == pytest.approx(now + d)


def test_bounded_kv_capacity_queues_requests():
    inst = EngineInstance(HW, block_size=16, kv_capacity_tokens=16 * 10)
    a = EngineRequest("a", 100, 20, [])  # 120 tokens: 8 blocks
    b = EngineRequest("b", 100, 20, [])
    inst.submit(a, 0.0)
    inst.submit(b, 0.0)
    run(inst)
    assert a.admitted_at == 0.0
    assert b.admitted_at == pytest.approx(a.finished_at)
    assert inst.num_waiting == 0


def test_request_larger_than_memory_fails_clearly():
    inst = EngineInstance(HW, block_size=16, kv_capacity_tokens=160)
    req = EngineRequest("a", 1000, 10, [])
    inst.submit(req, 0.0)
    results = run(inst)
    assert req.error and "more than this instance's 160" in req.error
    assert results[0][1].failed == [req]


def test_prefill_leg_holds_kv_until_released_and_remote_decode_pulls_the_rest():
    prefill = EngineInstance(HW, block_size=16)
    leg = EngineRequest("p", 64, 1, [1, 2, 3, 4], kind="prefill")
    prefill.submit(leg, 0.0)
    run(prefill)
    assert leg.finished_at == pytest.approx(HW.prefill_s(64))
    assert prefill.cache.used_blocks == 5  # 4 full blocks + 1 private (the output token)
    prefill.release(leg)
    assert prefill.cache.used_blocks == 4 and prefill.cache.evictable_blocks() == 4

    decode = EngineInstance(HW, block_size=16)
    decode.cache.try_allocate([1, 2], 0)  # it already caches the first two blocks
    decode.cache.release([1, 2], 0)
    remote = EngineRequest("d", 64, 3, [1, 2, 3, 4], kind="remote_decode")
    decode.submit(remote, 1.0)
    run(decode, 1.0)
    assert remote.transfer_tokens == 32
    first = 1.0 + HW.transfer_s(32) + HW.decode_step_s(1, 64)
    assert remote.first_token_at == pytest.approx(first)
    assert remote.finished_at == pytest.approx(first + HW.decode_step_s(1, 65) + HW.decode_step_s(1, 66))


@pytest.mark.parametrize("host_tier", [False, True])
def test_a_prefix_the_device_evicted_is_loaded_from_the_host_tier(host_tier):
    hw = HW.with_(host_kv_bytes=HW.kv_bytes(16 * 1000)) if host_tier else HW
    inst = EngineInstance(hw, block_size=16, kv_capacity_tokens=16 * 24)
    for rid, keys in (("a", range(20)), ("b", range(100, 120))):  # b evicts a's first 17 blocks
        inst.submit(EngineRequest(rid, 320, 1, list(keys)), 0.0)
        run(inst)
    again = EngineRequest("c", 330, 1, list(range(20)))
    inst.submit(again, 10.0)
    run(inst, 10.0)
    if host_tier:
        assert again.cached_tokens == again.host_tokens == 320 == inst.prompt_tokens_from_host
        ttft = hw.host_load_s(320) + hw.step_s([(10, 320)])
    else:
        assert again.cached_tokens == again.host_tokens == 0 == inst.prompt_tokens_from_host
        ttft = hw.prefill_s(330)
    assert again.first_token_at - 10.0 == pytest.approx(ttft)
    assert inst.prefill_tokens_computed == 320 + 320 + 330 - again.cached_tokens


def test_a_decode_leg_loads_from_its_host_tier_beside_the_transfer():
    hw = HW.with_(host_kv_bytes=HW.kv_bytes(16 * 1000))
    inst = EngineInstance(hw, block_size=16, kv_capacity_tokens=16 * 24)
    for rid, keys in (("a", range(20)), ("b", range(100, 120))):
        inst.submit(EngineRequest(rid, 320, 1, list(keys)), 0.0)
        run(inst)
    leg = EngineRequest("c", 352, 2, list(range(22)), kind="remote_decode")  # 2 blocks are new
    inst.submit(leg, 10.0)
    run(inst, 10.0)
    assert (leg.cached_tokens, leg.host_tokens, leg.transfer_tokens) == (320, 320, 32)
    wait = max(hw.transfer_s(32), hw.host_load_s(320))
    assert leg.first_token_at - 10.0 == pytest.approx(wait + hw.decode_step_s(1, 352))
