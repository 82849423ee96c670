"""bench/planner.py's workloads: phases of their own lengths, traces cut by answer length, and the
replay's shortened copy of them (bench/planner_replay.py)."""

from __future__ import annotations

import pytest

from bench import planner, planner_replay


@pytest.fixture(scope="module")
def traces_available():
    try:
        planner.cached_trace("mooncake_conv")
    except FileNotFoundError as e:  # the workloads are made from the shared traces
        pytest.skip(f"trace files not available: {e}")


def test_phase_bounds_default_and_own_lengths():
    assert planner.phase_bounds((("a", 1.0), ("b", 2.0))) == [(0.0, planner.PHASE_S),
                                                              (planner.PHASE_S, 2 * planner.PHASE_S)]
    assert planner.phase_bounds((("a", 1.0, 10.0), ("b", 2.0), ("c", 1.0, 30.0))) == [
        (0.0, 10.0), (10.0, 10.0 + planner.PHASE_S), (10.0 + planner.PHASE_S, 40.0 + planner.PHASE_S)]


def test_answer_cuts_split_the_trace_by_answer_length(traces_available):
    short, long = (planner.cached_trace(n) for n in ("mooncake_short_answers", "mooncake_long_answers"))
    assert short and long
    assert max(r.output_tokens for r in short) < 100
    assert min(r.output_tokens for r in long) >= 400
    every = planner.cached_trace("mooncake_conv")
    assert len(short) + len(long) < len(every)  # the answers in between are in neither


def test_a_longer_phase_holds_its_requests_for_longer(traces_available):
    requests = planner.workload(0, 1.0, planner.ANSWER_SHIFT)
    (s0, e0), (s1, e1), (s2, e2) = planner.phase_bounds(planner.ANSWER_SHIFT)
    assert (e0 - s0, e1 - s1, e2 - s2) == (150.0, 450.0, 150.0)
    half = planner.FADE_S / 2
    longs = [r for r in requests if r.output_tokens >= 400]
    shorts = [r for r in requests if r.output_tokens < 100]
    assert len(longs) + len(shorts) == len(requests)
    # each kind only where its phase (and its fades) are
    assert min(r.arrival_s for r in longs) >= s1 - half
    assert max(r.arrival_s for r in longs) <= e1 + half
    assert not [r for r in shorts if e0 + half < r.arrival_s < s2 - half]
    # the long phase's steady part holds its rate (x2 its trace's mean) over its 390 s
    trace = planner.cached_trace("mooncake_long_answers")
    mean_rate = len(trace) / (trace[-1].arrival_s - trace[0].arrival_s)
    steady = [r for r in longs if s1 + half <= r.arrival_s < e1 - half]
    expected = 2.0 * mean_rate * (e1 - s1 - 2 * half)
    assert 0.8 * expected < len(steady) < 1.2 * expected
    assert [r.request_id for r in requests] == list(range(len(requests)))


def test_the_replay_shortens_every_phase_alike(traces_available):
    phases = planner_replay.compressed_phases(60.0, planner.ANSWER_SHIFT)
    assert [p[2] for p in phases] == [60.0, 180.0, 60.0]
    assert [p[:2] for p in phases] == [p[:2] for p in planner.ANSWER_SHIFT]
    assert [p[2] for p in planner_replay.compressed_phases(60.0)] == [60.0] * len(planner.PHASES)
    requests = planner_replay.compressed_workload(60.0, phases=planner.ANSWER_SHIFT)
    assert max(r.arrival_s for r in requests) <= 300.0
