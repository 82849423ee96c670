"""The roofline: hand-computed values and the directions every curve must go."""

import pytest

from pd_plugins.perf.hardware import MODELS, PRESETS, preset


def test_kv_bytes_per_token_by_hand():
    # 2 (K, V) x layers x kv_heads x head_dim x 2 bytes
    assert MODELS["llama-3.1-8b"].kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert MODELS["qwen3-30b-a3b"].kv_bytes_per_token == 2 * 48 * 4 * 128 * 2


def test_prefill_is_compute_bound_and_equals_hand_computed():
    hw = preset("llama-3.1-8b@h100")
    flops = 2 * 8.03e9 * 1000 + 4 * 32 * 32 * 128 * (1000 * 1001 / 2)
    expected = 0.002 + flops / (989e12 * 0.5)
    assert hw.prefill_s(1000) == pytest.approx(expected, rel=1e-9)


def test_decode_step_is_memory_bound_and_equals_hand_computed():
    hw = preset("llama-3.1-8b@h100")
    bytes_ = 8.03e9 * 2 + 1000 * 131072
    assert hw.decode_step_s(1, 1000) == pytest.approx(0.002 + bytes_ / (3.35e12 * 0.8), rel=1e-9)


def test_moe_reads_only_the_experts_a_small_batch_activates():
    m = MODELS["qwen3-30b-a3b"]
    one = m.weight_bytes_read(1)
    assert one == pytest.approx((m.dense_params + m.expert_params * 8 / 128) * 2)
    assert m.active_params == pytest.approx(m.dense_params + m.expert_params * 8 / 128)
    reads = [m.weight_bytes_read(b) for b in (1, 2, 8, 64, 4096)]
    assert reads == sorted(reads) and reads[0] < reads[-1] <= m.total_params * 2 * 1.0001


@pytest.mark.parametrize("name", PRESETS)
def test_monotonic(name):
    hw = preset(name)
    prefills = [hw.prefill_s(n) for n in (1, 64, 512, 4096, 32768)]
    assert prefills == sorted(prefills) and len(set(prefills)) == len(prefills)
    assert hw.prefill_s(1000, cached_tokens=8000) > hw.prefill_s(1000)  # attends to the cache
    assert hw.prefill_s(1000, cached_tokens=8000) < hw.prefill_s(9000)  # but is far cheaper
    steps = [hw.decode_step_s(b, b * 2000) for b in (1, 8, 64, 256)]
    assert steps == sorted(steps)
    assert hw.decode_step_s(8, 100_000) > hw.decode_step_s(8, 1_000)
    assert hw.transfer_s(0) == 0 and hw.transfer_s(100) < hw.transfer_s(10_000)
    assert hw.kv_capacity_tokens() > 100_000


def test_h200_decodes_faster_and_holds_more_kv_than_h100():
    h100, h200 = preset("llama-3.1-8b@h100"), preset("llama-3.1-8b@h200")
    assert h200.decode_step_s(32, 200_000) < h100.decode_step_s(32, 200_000)
    assert h200.kv_capacity_tokens() > h100.kv_capacity_tokens()


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        preset("gpt-5@tpu")
