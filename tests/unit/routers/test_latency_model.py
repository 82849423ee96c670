import pytest

from pd_plugins.routers.policy.latency_model import OnlineLinearFit


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
