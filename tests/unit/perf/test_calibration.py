"""perf/calibration.py: a router's fitted latency lines as the simulator's engine timings."""

from __future__ import annotations

import json

import pytest

from pd_plugins.perf.calibration import DEFAULT_KV_CAPACITY_TOKENS, load_calibration
from pd_plugins.perf.cluster_sim import SimConfig, latency_priors, simulate
from pd_plugins.workloads.trace import TraceRequest

ENTRY = {"prefill_base_s": 0.01, "prefill_per_token_s": 3e-5, "decode_step_base_s": 0.008,
         "decode_step_per_request_s": 1e-4, "kv_bytes_per_token": 131072, "link_bytes_per_s": 50e9,
         "block_size": 16, "samples": {"prefill": 20, "decode_step": 20, "min_samples": 8}}


def exported(**models) -> dict:
    return {"models": models or {"llama": ENTRY}}


def test_loads_a_file_and_its_lines_time_the_steps(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(exported()))
    cal = load_calibration(path)
    hw = cal.hardware(kv_capacity_tokens=10_000)
    assert cal.name == "llama" and cal.block_size == 16 and hw.kv_capacity_tokens() == 10_000
    assert hw.prefill_s(1000) == pytest.approx(0.01 + 0.03)
    assert hw.decode_step_s(10) == pytest.approx(0.008 + 0.001)
    # a mixed step costs the slower of its parts (the roofline's max)
    assert hw.step_s([(1000, 0)], decode_batch=10) == pytest.approx(0.04)
    assert hw.step_s([(10, 0)], decode_batch=30) == pytest.approx(0.011)
    assert hw.step_s() == 0.0
    assert hw.transfer_s(1000) == pytest.approx(1000 * 131072 / 50e9)  # no decode_first line
    assert hw.model.experts == 0 and hw.model.kv_bytes_per_token == 131072
    priors = latency_priors(hw)  # the simulated router starts from the fit itself
    assert priors.prefill_per_token_s == 3e-5 and priors.decode_step_base_s == 0.008


def test_decode_first_line_times_the_pull():
    entry = {**ENTRY, "decode_first_base_s": 0.02, "decode_first_per_token_s": 2e-6,
             "samples": {**ENTRY["samples"], "decode_first": 9}}
    hw = load_calibration(exported(m=entry)).hardware()
    # sending the leg and pulling, less the first decode step the engine model adds itself
    assert hw.transfer_s(1000) == pytest.approx(0.02 - 0.0081 + 0.002)
    unfitted = {**entry, "samples": {**entry["samples"], "decode_first": 3}}
    assert load_calibration(exported(m=unfitted)).decode_first_base_s is None


@pytest.mark.parametrize("data, model, message", [
    ({"nope": 1}, None, "not a calibration"),
    (exported(a=ENTRY, b=ENTRY), None, "several models"),
    (exported(), "other", "no model 'other'"),
    (exported(m={**ENTRY, "prefill_per_token_s": -1}), None, "prefill_per_token_s"),
    (exported(m={**ENTRY, "decode_step_base_s": "fast"}), None, "decode_step_base_s"),
    (exported(m={**ENTRY, "samples": {"prefill": 3, "decode_step": 20, "min_samples": 8}}),
     None, "fitted from 3 samples"),
    # a step of no time: the planner's throughputs would divide by zero
    (exported(m={**ENTRY, "prefill_base_s": 0, "prefill_per_token_s": 0}), None,
     "prefill_base_s and prefill_per_token_s are both 0"),
    (exported(m={**ENTRY, "decode_step_base_s": 0.0, "decode_step_per_request_s": 0}), None,
     "decode_step_base_s and decode_step_per_request_s are both 0"),
    (exported(m=5), None, "model 'm': expected an object of fitted lines, got 5"),
    (exported(m={**ENTRY, "samples": [1, 2]}), None, "model 'm': samples must map"),
    (exported(m={**ENTRY, "samples": {**ENTRY["samples"], "prefill": "20"}}), None,
     "model 'm': samples must map"),
    (exported(m={**ENTRY, "samples": {**ENTRY["samples"], "decode_step": -1}}), None,
     "model 'm': samples must map"),
])
def test_refuses_what_is_not_a_usable_calibration(data, model, message):
    with pytest.raises(ValueError, match=message):
        load_calibration(data, model)


@pytest.mark.parametrize("text, message", [
    ("{not json", "Expecting property name"),
    (json.dumps(exported(m=5)), "model 'm': expected an object"),
    (json.dumps(exported(m={**ENTRY, "samples": [1]})), "model 'm': samples must map"),
    (b"\xff{}", "utf-8"),
])
def test_a_file_that_is_not_a_calibration_is_named_in_the_error(tmp_path, text, message):
    path = tmp_path / "cal.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as e:
        load_calibration(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)


def test_a_line_with_only_a_base_or_only_a_slope_is_fine():
    cal = load_calibration(exported(m={**ENTRY, "prefill_base_s": 0, "decode_step_per_request_s": 0}))
    assert cal.hardware().prefill_s(100) > 0 and cal.hardware().decode_step_s(4) > 0


def test_a_kv_capacity_of_zero_is_kept_not_replaced_by_the_default():
    cal = load_calibration(exported())
    assert cal.hardware(0).kv_capacity_tokens() == 0
    assert cal.hardware().kv_capacity_tokens() == DEFAULT_KV_CAPACITY_TOKENS


def test_priors_pass_when_asked():
    entry = {**ENTRY, "samples": {"prefill": 0, "decode_step": 0, "min_samples": 8}}
    assert load_calibration(exported(m=entry), require_fitted=False).prefill_base_s == 0.01


def test_simulation_runs_on_a_calibration():
    reqs = [TraceRequest(i, i * 0.5, 1024, 20, tuple(range(i * 100, i * 100 + 64)), block_tokens=16)
            for i in range(10)]
    cal = load_calibration(exported())
    result = simulate(reqs, SimConfig(cal.hardware(), 1, 1, block_tokens=16))
    assert all(o.status == "ok" for o in result.outcomes)
    for o in result.outcomes:  # alone in the cluster: its prefill, the pull, one decode step
        alone = 0.01 + 3e-5 * 1024 + 1024 * 131072 / 50e9 + 0.008 + 1e-4
        assert o.ttft_s == pytest.approx(alone, rel=0.1)
