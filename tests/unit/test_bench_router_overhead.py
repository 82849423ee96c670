"""bench/router_overhead.py's pure parts: the pairing with the direct run of the same mode, the
ratios to both Rust routers, issue 30's "Done when" checks, the wrk output parser and --tree's
router."""

from __future__ import annotations

import json

import pytest

from bench import router_overhead as ro

# wrk 4.1.0 with --latency, captured format (one unit of each kind among the percentiles).
WRK_OUT = """Running 2s test @ http://127.0.0.1:41234/v1/completions
  1 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    22.62ms    3.10ms   1.02s    90.12%
    Req/Sec     2.84k   150.21     3.01k    85.00%
  Latency Distribution
     50%  812.00us
     75%   23.40ms
     90%   25.12ms
     99%    1.20s
  5664 requests in 2.00s, 2.61MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 3
Requests/sec:   2829.54
Transfer/sec:      1.30MB
"""


def rep(p50, p99, cpu=None, routes=None):
    return {"n": 100, "sent": 100, "errors": 0, "error_samples": [], "rps": 1000.0,
            "p50_ms": p50, "p99_ms": p99, "cpu_us": cpu, "cpu_s": None, "window_s": 1.0,
            "foreign_pct": 0.0, "routes": routes or {}}


def target(key, stream=False):
    return ro.Target(ro.mode_key(key, stream), key, "http://unused", None, stream=stream)


# per (base key, concurrency): (p50, p99, cpu); streaming rows are 1 ms slower at p50
ROWS = {"direct": {1: (0.3, 0.5, None), 16: (2.5, 5.0, None), 64: (11.0, 20.0, None)},
        "pd-vllm": {1: (1.0, 2.0, 200), 16: (8.0, 12.0, 150), 64: (30.0, 50.0, 170)},
        "vllm-router": {1: (1.2, 2.0, 300), 16: (8.0, 13.0, 180), 64: (36.0, 60.0, 230)},
        "sglang-router": {1: (1.1, 1.8, 280), 16: (8.0, 14.0, 180), 64: (34.0, 55.0, 200)}}


def run_all(streams=(False, True)):
    targets, runs = [], {}
    for stream in streams:
        for key, by_c in ROWS.items():
            t = target(key, stream)
            targets.append(t)
            for c, (p50, p99, cpu) in by_c.items():
                runs[(t.key, c)] = [rep(p50 + stream, p99 + stream, cpu,
                                        {"disaggregated": 10} if key.startswith("pd-") else None)]
    return targets, runs


def test_added_latency_pairs_each_mode_with_its_own_direct_run():
    targets, runs = run_all()
    summary = ro.summarize(targets, runs)
    for key in ("pd-vllm", "pd-vllm:stream"):
        assert summary[key]["1"]["added_p50_ms"]["median"] == 1.0 - 0.3  # +1 ms on both sides
    assert summary["pd-vllm"]["1"]["routes"] == {"disaggregated": 10}


def test_checks_judge_cpu_against_vllm_router_and_latency_against_the_better_peer():
    targets, runs = run_all()
    checks = ro.checks(ro.summarize(targets, runs))
    # pd-vllm only (pd-sglang did not run): CPU, p99 at 64, added p50 at 1, for each mode
    assert len(checks) == 6
    cpu, p99, added = checks[:3]
    # CPU: 200/300 = 0.67 and 170/230 = 0.74 meet 0.8x, but 150/180 = 0.83 does not
    assert cpu[0] is False and "16: 0.83×" in cpu[1]
    # p99 at 64: 50 ms against the better of 60 and 55
    assert p99[0] is True and "sglang-router 55.00" in p99[1]
    # added p50 at 1: 0.7 ms against sglang-router's 0.8
    assert added[0] is True
    assert [ok for ok, _ in checks[3:]] == [False, True, True]  # streaming the same


def test_checks_count_the_repeats_that_met_each_goal_against_the_same_repeats_peers():
    """Three repeats: the verdict is the medians', and each goal says in how many repeats it held
    against the Rust routers' runs of that repeat (not against their median)."""
    targets, runs = run_all(streams=(False,))
    for (key, c), reps in list(runs.items()):
        p50, p99, cpu = ROWS[key.split(":")[0]][c]
        drift = (1.0, 1.5, 0.8)  # the machine's state, repeat by repeat: every target moves with it
        runs[(key, c)] = [rep(p50 * d, p99 * d, cpu and cpu * d) for d in drift]
    runs[("pd-vllm", 1)][2]["cpu_us"] = 0.9 * 300 * 0.8  # repeat 3: 0.9x vllm-router's
    runs[("pd-vllm", 64)][1]["p99_ms"] = 100.0  # repeat 2: worse than both peers' (90, 82.5)
    cpu, p99, added = ro.checks(ro.summarize(targets, runs))
    assert cpu[0] is False and "1: 0.72× (216 vs 300 µs; met in 2 of 3 repeats)" in cpu[1]
    assert "16: 0.83× (150 vs 180 µs; met in 0 of 3 repeats)" in cpu[1]
    assert p99[0] is True and p99[1].endswith("ms, met in 2 of 3 repeats")
    assert added[0] is True and added[1].endswith("met in 3 of 3 repeats")


def test_render_reads_a_summary_saved_before_spreads_kept_their_repeats():
    """results.json from before `by_repeat`: CPU from `cpu_us_by_repeat`, the rest from `values`
    where every repeat measured it (a shorter list could be out of step: left without)."""
    old = {"pd-vllm": {"1": {"cpu_us": {"median": 2.0, "min": 1.0, "max": 3.0, "values": [3.0, 1.0]},
                             "cpu_us_by_repeat": [3.0, None, 1.0],
                             "p99_ms": {"median": 5.0, "min": 4.0, "max": 6.0, "values": [4.0, 5.0, 6.0]},
                             "p50_ms": {"median": 1.0, "min": 1.0, "max": 1.0, "values": [1.0, 1.0]}}}}
    cell = ro.with_repeats(old, repeats=3)["pd-vllm"]["1"]
    assert cell["cpu_us"]["by_repeat"] == [3.0, None, 1.0]
    assert cell["p99_ms"]["by_repeat"] == [4.0, 5.0, 6.0]
    assert "by_repeat" not in cell["p50_ms"]


def test_a_missing_peer_or_row_is_not_measured_rather_than_met():
    targets, runs = run_all(streams=(False,))
    targets = [t for t in targets if t.base != "vllm-router"]
    checks = ro.checks(ro.summarize(targets, runs))
    assert checks[0][0] is None and "not measured" in checks[0][1]
    assert checks[1][0] is True and "vllm-router not measured" in checks[1][1]


META = {"command": "x", "date": "d", "runtime_s": 60, "machine": "m", "versions": "v",
        "warm_s": 1, "window_s": 4, "repeats": 1, "foreign_pct": None}


def section(**meta) -> str:
    """The docs section of run_all()'s runs, with META and `meta`."""
    targets, runs = run_all()
    info = [{"key": t.key, "label": t.label, "broken": None, "stream": t.stream} for t in targets]
    return ro.markdown({**META, **meta}, info, ro.summarize(targets, runs))


def test_markdown_has_both_modes_the_ratio_table_and_the_check_list():
    text = section()
    assert text.startswith(f"<!-- {ro.SECTION}:start -->") and text.endswith(f"<!-- {ro.SECTION}:end -->\n")
    assert "| pd-vllm | streaming | 64 |" in text
    assert "| pd-vllm | non-streaming | 0.67× / 0.71× | 0.83× / 0.83× |" in text
    assert "- [ ] not met: pd-router (vLLM pull), streaming: CPU per request" in text
    assert "- [x] met: pd-router (vLLM pull), non-streaming: p99 at concurrency 64" in text
    # every table row has as many cells as its header
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len({line.count(" | ") for line in rows if "---" not in line}) == 2  # two tables


def test_parse_wrk_reads_requests_percentiles_in_every_unit_and_errors():
    w = ro.parse_wrk(WRK_OUT)
    assert w["requests"] == 5664 and w["duration_s"] == 2.0
    assert w["p50_ms"] == pytest.approx(0.812) and w["p99_ms"] == pytest.approx(1200.0)
    assert w["non2xx"] == 3
    assert w["socket_errors"] == {"connect": 0, "read": 2, "write": 0, "timeout": 1}
    # a clean run prints neither error line; a ms p99 and a run time in ms
    clean = (WRK_OUT.replace("  Socket errors: connect 0, read 2, write 0, timeout 1\n", "")
             .replace("  Non-2xx or 3xx responses: 3\n", "").replace("1.20s", "3.50ms")
             .replace("requests in 2.00s", "requests in 999.50ms"))
    w = ro.parse_wrk(clean)
    assert w["non2xx"] == 0 and w["socket_errors"] == {}
    assert w["p99_ms"] == pytest.approx(3.5) and w["duration_s"] == pytest.approx(0.9995)


def test_parse_wrk_refuses_output_without_a_summary():
    with pytest.raises(ValueError):
        ro.parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")


def test_markdown_names_the_load_generator_and_how_it_counts():
    text = section(window_s=2, loadgen="wrk",
                   core_busy_c64={"load_core_pct": ro.spread([97.0, 99.0]),
                                  "router_pct": ro.spread([60.0, 90.0])})
    assert "- Load generator: `wrk`" in text and "does not check bodies" in text
    assert "pd_router_requests_total" in text and "core 1 was 98% busy" in text
    text = section(window_s=2, loadgen="aiohttp", core_busy_c64={})
    assert "- Load generator: `aiohttp`" in text and "Every response is checked" in text


def test_markdown_states_the_workload_and_request_bodies_follow_max_tokens():
    assert f"{ro.MAX_TOKENS} output tokens" in section()  # older results have neither field
    text = section(max_tokens=64, tpot_ms=1.0)
    assert "64 output tokens" in text and "1 ms per token (a stream comes token by token)" in text
    bodies = ro.request_bodies(64)
    assert [json.loads(bodies[s])["max_tokens"] for s in (False, True)] == [64, 64]
    assert json.loads(bodies[True])["stream"] is True


def test_the_window_at_64_connections_is_twice_as_long_and_the_method_says_so():
    assert ro.window_at(1, 4.0) == ro.window_at(16, 4.0) == 4.0
    assert ro.window_at(64, 4.0) == 8.0
    assert "then a 2 s window (4 s at concurrency 64" in section(window_s=2)


def test_another_checkouts_router_runs_that_checkouts_code(tmp_path):
    """--tree: the other checkout's pd-router imports its own pd_plugins, never this checkout's
    (which `python -m` would put first on sys.path from the current directory)."""
    other = ro.CheckoutRouter("pd-router-vllm-before", log_dir=tmp_path)
    other.tree = "/tmp/before"
    env = other.environment()
    assert env["PYTHONPATH"] == "/tmp/before" and env["PYTHONSAFEPATH"] == "1"
    assert "pd_plugins.routers" in other.command()


def test_ab_rows_are_read_repeat_by_repeat_against_this_checkouts_router():
    """--tree and the lean router: each repeat's CPU over pd-router's of the same repeat, so a
    drift of the machine between repeats (both rows move together) does not show as a difference;
    a repeat either row did not measure is left out, not paired with another."""
    def cpu(*values):
        return {"cpu_us": ro.spread(list(values))}

    summary = {"pd-vllm": {}, "lean": {}, "pd-vllm@before": {}}
    for c in ro.CONCURRENCY:
        summary["pd-vllm"][str(c)] = cpu(100.0, 200.0, 150.0, None)
        summary["lean"][str(c)] = cpu(70.0, 150.0, 120.0, 90.0)
        summary["pd-vllm@before"][str(c)] = cpu(None, None, None, 80.0)  # only where pd-vllm has none
    targets = [{"key": "pd-vllm", "label": "pd-router (vLLM pull)"},
               {"key": "lean", "label": "lean"}, {"key": "pd-vllm@before", "label": "before"}]
    lines = ro.paired_lines(targets, summary)
    assert len(lines) == 2  # pd-router itself is the base, not a row
    assert "0.75× (0.70–0.80)" in lines[0]  # 0.70, 0.75, 0.80: not 120/150 of the medians
    assert "—" in lines[1] and "×" not in lines[1]  # no repeat with both: nothing paired
