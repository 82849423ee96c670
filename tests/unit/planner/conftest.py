"""A small stationary slice of the Mooncake conversation trace, shared by the planner's tests."""

from __future__ import annotations

import pytest

from pd_plugins.perf.cluster_sim import SimConfig
from pd_plugins.perf.hardware import preset
from pd_plugins.perf.report import Slo
from pd_plugins.workloads import TRACES, load_mooncake, slice_window, spread_bursts

SLO = Slo(ttft_s=5.0, tpot_s=0.05)
HARDWARE = "llama-3.1-8b@h100"


@pytest.fixture(scope="session")
def mooncake_slice():
    """One minute of the trace, ten minutes in (its rate is steady there), bursts spread."""
    try:
        path = TRACES["mooncake_conv"]
    except FileNotFoundError as e:
        pytest.skip(f"trace files not available: {e}")
    if not path.is_file():
        pytest.skip(f"trace file {path} missing")
    return slice_window(spread_bursts(load_mooncake(path), 3.0), 600, 60)


@pytest.fixture
def sim_base():
    return SimConfig(preset(HARDWARE))
