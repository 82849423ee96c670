"""Dynamo's sizing rule on numbers worked out by hand."""

from __future__ import annotations

import pytest

from pd_plugins.perf.calibration import load_calibration
from pd_plugins.perf.hardware import preset
from pd_plugins.planner.dynamo_rule import (budget_split, decode_throughput, dynamo_demand,
                                            dynamo_split, prefill_throughput, replicas)
from pd_plugins.planner.split import Split
from pd_plugins.workloads import TraceRequest


def calibrated(prefill_base_s=0.02, prefill_per_token_s=1e-4, decode_step_base_s=0.01,
               decode_step_per_request_s=1e-3):
    """A router calibration (GET /admin/calibration's answer) with round numbers."""
    return load_calibration({"models": {"m": {
        "prefill_base_s": prefill_base_s, "prefill_per_token_s": prefill_per_token_s,
        "decode_step_base_s": decode_step_base_s, "decode_step_per_request_s": decode_step_per_request_s,
        "kv_bytes_per_token": 131072, "link_bytes_per_s": 50e9, "block_size": 16,
        "samples": {"prefill": 100, "decode_step": 100, "min_samples": 8}}}}).hardware()


def uniform_requests(rate: float, isl: int, osl: int, n: int = 101) -> list[TraceRequest]:
    return [TraceRequest(i, i / rate, isl, osl, (i,) * -(-isl // 512)) for i in range(n)]


def test_hand_computed_example():
    profile = calibrated()
    # prefill of 1000 tokens alone: 0.02 + 0.1 = 0.12 s -> 8333 tokens/s
    assert prefill_throughput(profile, 1000) == pytest.approx(1000 / 0.12)
    # a decode step of b requests: 0.01 + 0.001 b <= 50 ms up to b = 40: 40 / 0.05 = 800 tokens/s
    assert decode_throughput(profile, 1100, 0.05) == (pytest.approx(800.0), 40)
    # 10 req/s of 1000 in, 200 out: prefill 10 * 1000 / 8333 = 1.2 -> 2; decode 10 * 200 / 800
    # = 2.5 -> 3
    demand = dynamo_demand(10.0, 1000, 200, profile, 0.05)
    assert demand.prefill_load == pytest.approx(1.2)
    assert demand.decode_load == pytest.approx(2.5)
    assert replicas(demand) == Split(2, 3)
    # a budget of 10 divided 1.2 : 2.5 -> 3.24 -> 3 prefill, 7 decode
    assert budget_split(demand, 10) == Split(3, 7)
    # from requests: their rate and mean lengths
    requests = uniform_requests(10.0, 1000, 200)
    assert dynamo_split(requests, profile=profile, itl_s=0.05) == Split(2, 3)
    assert dynamo_split(requests, profile=profile, itl_s=0.05, instances=10) == Split(3, 7)
    assert dynamo_split(requests, profile=profile, itl_s=0.05, rate=20.0) == Split(3, 5)


def test_kv_capacity_and_batch_cap_bound_the_decode_batch():
    profile = calibrated()
    # 40 requests of 1100 tokens would need 44,000 KV tokens; 22,000 hold 20 of them
    assert decode_throughput(profile, 1100, 0.05, kv_capacity_tokens=22_000) == (
        pytest.approx(20 / 0.03), 20)
    assert decode_throughput(profile, 1100, 0.05, max_batch=8) == (pytest.approx(8 / 0.018), 8)


def test_unmeetable_itl_says_so():
    with pytest.raises(ValueError, match="ITL target"):
        dynamo_demand(1.0, 1000, 100, calibrated(decode_step_base_s=0.06), 0.05)


def test_roofline_profile_long_prompts_want_more_prefill():
    hw = preset("llama-3.1-8b@h100")
    code = dynamo_split(uniform_requests(5.0, 8000, 50), profile=hw, itl_s=0.05, instances=8)
    chat = dynamo_split(uniform_requests(5.0, 500, 800), profile=hw, itl_s=0.05, instances=8)
    assert code.prefill > chat.prefill
    assert code.instances == chat.instances == 8
    # the roofline's own numbers: one 8000-token prefill alone
    assert prefill_throughput(hw, 8000) == pytest.approx(8000 / hw.prefill_s(8000))
