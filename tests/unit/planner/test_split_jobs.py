"""plan_split with worker processes finds what it finds in one process."""

from __future__ import annotations

import pytest

from pd_plugins.planner.split import plan_split
from tests.unit.planner.conftest import SLO

pytestmark = pytest.mark.processes


def test_two_processes_agree_with_one(mooncake_slice, sim_base):
    one = plan_split(mooncake_slice, slo=SLO, instances=5, sim_base=sim_base)
    two = plan_split(mooncake_slice, slo=SLO, instances=5, sim_base=sim_base, jobs=2)
    assert two.best == one.best
    assert two.best_curve().goodput == pytest.approx(one.best_curve().goodput)
    assert [c.split for c in two.curve] == [c.split for c in one.curve]
    for a, b in zip(one.curve, two.curve):   # a split both searched fully has one goodput
        if a.goodput is not None and b.goodput is not None:
            assert a.goodput == pytest.approx(b.goodput)
