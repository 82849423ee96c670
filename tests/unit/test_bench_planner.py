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


def test_the_first_workload_is_the_one_its_results_were_measured_on(traces_available):
    """Phases of their own lengths changed the builder, not the default workload: the requests
    of docs/benchmarks.md's "Planner" runs (seed 0, x1), pinned by their totals."""
    requests = planner.workload(0, 1.0)
    assert (len(requests), sum(r.output_tokens for r in requests),
            sum(r.input_tokens for r in requests)) == (16071, 1962360, 28194959)
    assert sum(r.arrival_s for r in requests) == pytest.approx(2815270.312, abs=0.01)


def test_phase_attainment_reads_phases_of_their_own_lengths():
    """Each phase's steady part (outside the fades) from the run's bounds, not k * PHASE_S."""
    meta = {"interval_s": 10.0, "fade_s": 20.0, "phases": [["a", 1], ["b", 1]],
            "bounds": [(0.0, 30.0), (30.0, 120.0)]}
    # per interval: 1.0 in the first phase, 0.5 in the second, None where nothing arrived
    run = {"window_attainment": [1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, None, 0.5, 0.5, 0.5]}
    # phase a: [0, 20) (its end's half fade cut), phase b: [40, 120); the fade's 0.0s left out
    assert planner.phase_attainment(run, meta) == [1.0, 0.5]
    old = {"interval_s": 10.0, "fade_s": 0.0, "phases": [["a", 1], ["b", 1]], "phase_s": 20.0}
    assert planner.meta_bounds(old) == [(0.0, 20.0), (20.0, 40.0)]


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
    fade = planner.FADE_S
    requests = planner_replay.compressed_workload(60.0, phases=planner.ANSWER_SHIFT)
    assert planner.FADE_S == fade  # set for the call only
    assert max(r.arrival_s for r in requests) <= 300.0
    # the long phase is 60..240 s, its fades 24 s: long answers only in [48, 252]
    longs = [r.arrival_s for r in requests if r.output_tokens >= 400]
    assert longs and 48.0 <= min(longs) and max(longs) <= 252.0


def test_a_replayed_decision_can_be_decided_again_offline(traces_available):
    """The replay's controller logs each LivePlanner re-plan's inputs (decision_inputs); redecide
    gives the decision the planner made from them, after a JSON round trip."""
    import json

    from pd_plugins.planner.live import RouterTraffic
    from pd_plugins.planner.types import Split

    requests = planner_replay.compressed_workload(30.0)
    window = [r for r in requests if r.arrival_s < 15.0]
    assert len(window) >= 20  # enough for the planner to simulate, not to stay on a thin window
    traffic = RouterTraffic(15.0, window, window[-3:], window[-6:-3])
    logged = json.loads(json.dumps(planner_replay.decision_inputs(15.0, Split(2, 2), False, traffic)))
    skipped = json.loads(json.dumps(planner_replay.decision_inputs(30.0, Split(2, 2), True, traffic)))
    live = planner_replay.new_live_planner().decide(15.0, window, Split(2, 2), window[-3:],
                                                    window[-6:-3])
    # a re-plan during a move is skipped, as apply_once skips it
    again = planner_replay.redecide([logged, skipped])
    assert [(d.want, d.reason) for d in again] == [(live.want, live.reason)]
    assert again[0].scores == live.scores


def test_a_window_every_split_fails_is_judged_by_how_fast_each_works_it_off(monkeypatch):
    """A re-plan logged over HTTP (answer_shift, 135 s: 29 requests in the window, 17 long
    answers in progress on 2P:2D): every split was predicted to serve under 12% of the window
    within the SLOs (3P:1D about 3 requests, 2P:2D none). Judged by how fast each works the
    queue off, the planner keeps 2P:2D; judged by those few requests (before FEW_SERVED_SHARE) it
    moved to 3P:1D, and back at the next re-plan."""
    import json
    from pathlib import Path

    import pd_plugins.planner.live as live

    logged = json.loads((Path(__file__).parent / "planner_replay_window.json").read_text())
    assert logged["split"] == [2, 2] and not logged["moving"]
    decision = planner_replay.redecide([logged])[0]
    assert not decision.moves, decision.reason
    assert max(decision.scores.values()) < 0.15 * len(logged["window"]) / planner.WINDOW_S
    monkeypatch.setattr(live, "FEW_SERVED_SHARE", 0.0)
    before = planner_replay.redecide([logged])[0]
    assert before.moves and str(before.want) == "3P:1D", before.reason


def test_the_phase_oracle_takes_each_phases_best_static_split_weighted_by_its_requests(
        traces_available):
    """phase_oracle(): per phase the static split that served most of its requests, the
    intervals weighted by their arrivals, with the phases' lengths read from the results."""
    bounds = planner.phase_bounds(planner.ANSWER_SHIFT)
    step, windows = 15.0, 51
    short = [bounds[0][0] <= (i + 0.5) * step < bounds[0][1]
             or bounds[2][0] <= (i + 0.5) * step < bounds[2][1] for i in range(windows)]

    # results from before run() kept each interval's arrivals: the workload is built again
    requests = {scale: len(planner.workload(0, scale, planner.ANSWER_SHIFT))
                for scale in (0.5, 1.0)}

    def results(statics: dict[int, list[float]]) -> dict:
        meta = {"interval_s": step, "fade_s": planner.FADE_S, "seeds": [0], "scales": [0.5, 1.0],
                # as results store them: a phase's length only in its bounds
                "phases": [[n, x] for n, x, _ in planner.ANSWER_SHIFT], "bounds": bounds}
        runs = [{"seed": 0, "scale": scale, "strategy": "static", "prefill": p, "rate": 4.0 * scale,
                 "window_attainment": attainment, "requests": requests[scale]}
                for scale in meta["scales"] for p, attainment in statics.items()]
        return {"meta": meta, "runs": runs}

    only_short = [1.0 if s else 0.0 for s in short]
    only_long = [0.0 if s else 1.0 for s in short]
    both = planner.phase_oracle(results({1: only_short, 2: only_long, 3: [0.6] * windows}))[0]
    assert both["attainment"] == 1.0 and both["goodput"] == 4.0 and both["goodput_at_load"] == 4.0

    arrived = [0] * windows
    for r in planner.workload(0, 1.0, planner.ANSWER_SHIFT):
        arrived[min(int(r.arrival_s // step), windows - 1)] += 1
    share = sum(n for n, s in zip(arrived, short) if s) / sum(arrived)
    assert 0.2 < share < 0.9  # both kinds of phase hold many requests
    alone = planner.phase_oracle(results({1: only_short}))[0]
    assert alone["attainment"] == pytest.approx(share)


def quick_results(attainment: float) -> dict:
    """Results shaped like `bench.planner --quick --workload answer_shift` (one repeat, x0.9 and
    x1), every run at `attainment` in every interval."""
    bounds = planner.phase_bounds(planner.ANSWER_SHIFT)
    step = planner.INTERVAL_S
    windows = int(bounds[-1][1] // step) + 1
    meta = {"hardware": planner.HARDWARE, "instances": 8, "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
            "policy": planner.POLICY, "workload": "answer_shift",
            "phases": [[n, x] for n, x, _ in planner.ANSWER_SHIFT], "bounds": bounds,
            "phase_s": planner.PHASE_S, "fade_s": planner.FADE_S, "interval_s": step,
            "window_s": planner.WINDOW_S, "hysteresis": {"margin": 0.05, "min_dwell_s": 60.0},
            "seeds": [0], "headroom": 1.5, "replay_lead": True, "jobs": 1,
            "scales": list(planner.QUICK_SCALES), "machine": "test", "wall_s": 60.0,
            "date": "2026-12-06"}
    runs = []
    for scale in meta["scales"]:
        strategies = [("static", p) for p in range(1, 8)] + [("dynamo", 4), ("live", 4)]
        for strategy, prefill in strategies:
            rate = 5.0 * scale
            runs.append({"strategy": strategy, "prefill": prefill, "seed": 0, "scale": scale,
                         "requests": 10 * windows, "rate": rate, "attainment": attainment,
                         "goodput_at_load": attainment * rate, "rejected": 0, "lost": 0,
                         "cached_share": [0.0] * 3, "window_attainment": [attainment] * windows,
                         "window_requests": [10] * windows,
                         "split_log": [[0.0, prefill, 8 - prefill]],
                         "moves": 0, "planner_simulations": 0, "cpu_s": 1.0})
    return {"meta": meta, "runs": runs}


@pytest.mark.parametrize("attainment", [0.5, 0.95])
def test_the_report_renders_a_quick_run_under_and_over_90_percent(attainment):
    """--quick sweeps x0.9 and x1 only: at 0.5 no split reaches 90% (no DistServe goodput, no
    finite ratio), at 0.95 every one does at every rate (a lower limit, marked so)."""
    text = planner.markdown(quick_results(attainment))
    (line,) = [x for x in text.splitlines() if x.startswith("What choosing a split per phase")]
    if attainment < 0.9:
        assert "none (under 90% at every rate swept)" in line
        assert "no finite ratio" in line
    else:
        assert "DistServe goodput >= 5" in line and "1x" in line
