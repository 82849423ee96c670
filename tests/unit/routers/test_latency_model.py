import random

import pytest

from pd_plugins.routers.config import LatencySpec
from pd_plugins.routers.policy.latency_model import LatencyModels, OnlineLinearFit


def test_fit_uses_prior_until_enough_samples_then_recovers_the_line():
    fit = OnlineLinearFit(prior_a=1.0, prior_b=2.0, min_samples=4)
    fit.observe(10, 0.03)
    assert fit.coefficients == (1.0, 2.0)
    for x in (0, 50, 100, 200, 400):
        fit.observe(x, 0.02 + 0.001 * x)
    a, b = fit.coefficients
    assert a == pytest.approx(0.02, abs=1e-6) and b == pytest.approx(0.001, rel=1e-6)


def test_fit_forgets_old_samples():
    fit = OnlineLinearFit(0.0, 0.0, decay=0.8, min_samples=2)
    for x in (10, 20) * 20:
        fit.observe(x, 1.0 * x)
    for x in (10, 20) * 40:
        fit.observe(x, 0.1 * x)  # the machine got 10x faster
    assert fit.predict(100) == pytest.approx(10.0, rel=0.05)


def test_samples_at_one_x_keep_the_prior_slope():
    fit = OnlineLinearFit(0.0, 0.5, min_samples=2)
    for _ in range(5):
        fit.observe(8, 6.0)
    assert fit.coefficients == (2.0, 0.5)


def test_a_negative_intercept_refits_the_line_through_the_origin():
    # slightly superlinear prefill (attention): the least-squares line has a < 0
    samples = [(x, 3e-5 * x + 4e-9 * x * x) for x in range(2000, 8001, 500)]
    fit = OnlineLinearFit(0.02, 0.0002, decay=1.0)
    for x, y in samples:
        fit.observe(x, y)
    a, b = fit.coefficients
    assert a == 0.0
    assert b == pytest.approx(sum(x * y for x, y in samples) / sum(x * x for x, _ in samples))
    mean_y = sum(y for _, y in samples) / len(samples)
    assert fit.predict(5000) == pytest.approx(mean_y, rel=0.1)  # clamping a alone: +33%


def test_a_fixed_length_workload_is_predicted_near_its_measured_time():
    """8 legs of 984 or 1000 uncached tokens (one block cached or not), 70 ms with 5 ms of jitter:
    clamping the intercept predicted up to 12.8x the measured time at the measured size."""
    worst = 1.0
    for seed in range(200):
        rng = random.Random(seed)
        fit = OnlineLinearFit(0.02, 0.0002)
        samples = [(rng.choice((1000, 984)), 0.07 + rng.gauss(0, 0.005)) for _ in range(8)]
        for x, y in samples:
            fit.observe(x, y)
        mean_y = sum(y for _, y in samples) / len(samples)
        ratio = fit.predict(992) / mean_y
        worst = max(worst, ratio, 1 / ratio)
    assert worst < 1.5


def test_samples_with_a_tiny_spread_do_not_set_the_slope():
    # 20 ms + 50 us/token; 8 legs of 1000 or 1001 tokens, +-10 ms of jitter: the jitter's slope
    # was 12,591 us/token (a 4000-token prefill predicted at 50 s)
    models = LatencyModels(LatencySpec())
    for x, jitter in [(1000, -0.01), (1000, 0.0), (1000, -0.01), (1001, 0.01), (1000, 0.0),
                      (1001, 0.01), (1000, -0.01), (1001, 0.0)]:
        models.prefill.observe(x, 0.02 + 5e-5 * x + jitter)
    for n in (500, 1000, 2000, 4000):
        true = 0.02 + 5e-5 * n
        assert true / 1.5 < models.prefill_s(n) < true * 1.5, n


def test_decode_steps_at_one_batch_size_stay_near_their_measured_time():
    # the decode step line, same class: steps timed at a batch of 32 or 33, 30 ms +- 3 ms
    for seed in range(100):
        rng = random.Random(seed)
        models = LatencyModels(LatencySpec())  # prior 20 ms + 2 ms per request
        steps = [(rng.choice((32, 33)), 0.03 + rng.uniform(-0.003, 0.003)) for _ in range(10)]
        for batch, step in steps:
            models.decode_step.observe(batch, step)
        mean = sum(s for _, s in steps) / len(steps)
        assert models.decode_step_s(32.5) == pytest.approx(mean, rel=0.1), seed
        assert models.decode_step_s(64) < 2.2 * mean, seed  # at most in proportion to the batch
