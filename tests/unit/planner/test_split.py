"""plan_split against brute force: every split simulated at every rate, independently."""

from __future__ import annotations

import dataclasses

import pytest

from pd_plugins.perf.cluster_sim import simulate
from pd_plugins.perf.report import goodput, summarize
from pd_plugins.planner.split import Split, format_table, plan_split, policy_for_slo
from pd_plugins.workloads import scale_time
from tests.unit.planner.conftest import SLO

POLICY = "default"
RATES = [4.0 * 1.25 ** i for i in range(6)]   # 4 .. 12.2 req/s: the 5-instance splits cross 90% here


def attainment(requests, sim_base, split: Split, rate: float) -> float:
    """One simulation, written out here rather than taken from the planner."""
    native = len(requests) / (requests[-1].arrival_s - requests[0].arrival_s)
    config = dataclasses.replace(sim_base, prefill_instances=split.prefill,
                                 decode_instances=split.decode, policy=policy_for_slo(POLICY, SLO))
    result = simulate(scale_time(requests, rate / native), config)
    return summarize(result.outcomes, SLO, result.sim_span_s, cached_tokens=0, computed_tokens=0,
                     kv_bytes_moved=0.0)["slo_attainment"]


def test_recommended_split_matches_brute_force(mooncake_slice, sim_base):
    instances = 5
    brute = {}
    for p in range(1, instances):
        split = Split(p, instances - p)
        brute[split] = goodput(RATES, [attainment(mooncake_slice, sim_base, split, r) for r in RATES])
    best_goodput = max(brute.values())
    # the comparison means something only if the splits differ and the best crosses 90% inside
    assert min(brute.values()) < 0.8 * best_goodput
    assert RATES[0] < best_goodput < RATES[-1]

    lines: list[str] = []
    plan = plan_split(mooncake_slice, slo=SLO, policy=POLICY, instances=instances, sim_base=sim_base,
                      rates=RATES, progress=lines.append)

    assert brute[plan.best] == pytest.approx(best_goodput), (brute, format_table(plan))
    assert plan.best_curve().goodput == pytest.approx(best_goodput)
    for curve in plan.curve:   # every goodput it reports is brute force's; the rest it ruled out
        if curve.goodput is not None:
            assert curve.goodput == pytest.approx(brute[curve.split])
        else:
            assert brute[curve.split] < curve.below <= best_goodput
    assert {c.split for c in plan.curve} == set(brute)
    assert plan.simulations < len(brute) * len(RATES)   # bisection and bounds pay
    assert len(lines) == instances - 1 and all("P:" in line for line in lines)


def test_target_rate_finds_the_fewest_instances(mooncake_slice, sim_base):
    target = 6.0
    fewest = None
    for n in range(2, 8):   # brute force: the first count with a split at >= 90% attainment
        if any(attainment(mooncake_slice, sim_base, Split(p, n - p), target) >= 0.9
               for p in range(1, n)):
            fewest = n
            break
    assert fewest is not None and fewest > 2   # a target two instances already meet tests little

    plan = plan_split(mooncake_slice, slo=SLO, policy=POLICY, target_rate=target, sim_base=sim_base)

    assert plan.mode == "target_rate"
    assert plan.instances == fewest
    assert plan.best.instances == fewest
    assert plan.best_curve().attainment[target] >= 0.9
    assert plan.tried[fewest - 1] < 0.9   # it saw the count below fail
    assert "attainment" in format_table(plan)


def test_plan_split_refuses_bad_arguments(mooncake_slice, sim_base):
    with pytest.raises(ValueError, match="either"):
        plan_split(mooncake_slice, slo=SLO, sim_base=sim_base)
    with pytest.raises(ValueError, match="either"):
        plan_split(mooncake_slice, slo=SLO, sim_base=sim_base, instances=4, target_rate=2.0)
    with pytest.raises(ValueError, match="at least 2"):
        plan_split(mooncake_slice, slo=SLO, sim_base=sim_base, instances=1)
    with pytest.raises(ValueError, match="no requests"):
        plan_split([], slo=SLO, sim_base=sim_base, instances=4)
