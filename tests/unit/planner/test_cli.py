"""pd-planner end to end, in this process: a minute of a real trace, a traffic record, bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pd_plugins.planner.cli import main
from pd_plugins.workloads import TRACES


@pytest.fixture
def mooncake_available():
    try:
        if not TRACES["mooncake_conv"].is_file():
            pytest.skip("trace file missing")
    except FileNotFoundError as e:
        pytest.skip(f"trace files not available: {e}")


def test_trace_to_table_plot_and_json(mooncake_available, tmp_path, capsys):
    plot, out = tmp_path / "split.png", tmp_path / "plan.json"
    rc = main(["--trace", "mooncake_conv", "--start", "600", "--duration", "30",
               "--slo-ttft-ms", "5000", "--slo-tpot-ms", "50", "--instances", "3",
               "--plot", str(plot), "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "best split of 3 instances:" in captured.out
    assert "| 1P:2D" in captured.out and "| 2P:1D" in captured.out
    assert "**best**" in captured.out
    assert captured.err.count("simulations") == 2   # progress: one line per split
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    plan = json.loads(out.read_text())
    assert plan["mode"] == "goodput" and plan["instances"] == 3
    assert {(c["prefill"], c["decode"]) for c in plan["curve"]} == {(1, 2), (2, 1)}
    best = (plan["best"]["prefill"], plan["best"]["decode"])
    assert f"best split of 3 instances: {best[0]}P:{best[1]}D" in captured.out


def write_record(path, n=120, gap_s=0.25):
    """A traffic record as pd-router writes it: chat requests sharing a 48-token system prompt."""
    path.write_text("".join(json.dumps({
        "t": 1_700_000_000 + i * gap_s, "model": "m", "input_tokens": 600 + 16 * (i % 7),
        "output_tokens": 40 + i % 13, "block_keys": [11, 22, 33], "block_size": 16,
        "session": None, "turn": None, "decision": "disaggregated", "prefill": "http://p",
        "decode": "http://d", "ttft_s": 0.2, "tpot_s": 0.02, "e2e_s": 1.0, "status": 200}) + "\n"
        for i in range(n)))
    return path


def test_traffic_record_with_calibration(tmp_path, capsys):
    """A record planned against a calibration file as GET /admin/calibration answers."""
    record = write_record(tmp_path / "traffic.jsonl")
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"models": {"m": {
        "prefill_base_s": 0.01, "prefill_per_token_s": 5e-5, "decode_step_base_s": 0.008,
        "decode_step_per_request_s": 4e-4, "kv_bytes_per_token": 131072, "link_bytes_per_s": 25e9,
        "block_size": 16, "samples": {"prefill": 50, "decode_step": 50, "min_samples": 8}}}}))
    rc = main(["--record", str(record), "--calibration", str(calibration), "--model", "m",
               "--slo-ttft-ms", "500", "--slo-tpot-ms", "30", "--target-rate", "20", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "fewest instances for 20 req/s:" in captured.out
    assert "instances tried" in captured.out
    assert captured.err == ""   # --quiet


def test_bad_input_is_refused_with_a_reason(tmp_path, capsys):
    rc = main(["--trace", str(tmp_path / "none.jsonl"), "--slo-ttft-ms", "1000",
               "--slo-tpot-ms", "50", "--instances", "4"])
    assert rc == 2 and "none.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--trace", "mooncake_conv", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50"])
    assert "--instances" in capsys.readouterr().err
    record = write_record(tmp_path / "traffic.jsonl", n=10)
    with pytest.raises(SystemExit):
        main(["--record", str(record), "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50",
              "--instances", "4", "--sample", "1"])
    assert "--sample must be at least 2" in capsys.readouterr().err
    rc = main(["--record", str(record), "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50",
               "--instances", "4", "--hardware", "nope@h100"])
    assert rc == 2 and "unknown hardware preset" in capsys.readouterr().err


def test_a_host_tier_saves_prefill_work_the_device_cache_cannot(mooncake_available):
    """The Mooncake trace's prefixes come back after millions of tokens: an instance with 100k
    tokens of KV recomputes them, one with 64 GB of host memory for KV copies loads them."""
    from pd_plugins.perf.cluster_sim import simulate
    from pd_plugins.planner.split import sim_config
    from pd_plugins.workloads import load_mooncake, slice_window

    requests = slice_window(load_mooncake(TRACES["mooncake_conv"]), 600, 120)
    runs = {gb: simulate(requests, dataclasses.replace(
                sim_config(hardware="llama-3.1-8b@h100", kv_capacity_tokens=100_000,
                           host_kv_gb=gb), prefill_instances=2, decode_instances=2))
            for gb in (0.0, 64.0)}
    assert runs[0.0].prompt_tokens_from_host == 0
    assert runs[64.0].prompt_tokens_from_host > 0
    assert runs[64.0].prompt_tokens_cached > runs[0.0].prompt_tokens_cached
    assert runs[64.0].prefill_tokens_computed < runs[0.0].prefill_tokens_computed
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="host_kv_gb"):
            sim_config(host_kv_gb=bad)


def write_calibration(path, **over):
    path.write_text(json.dumps({"models": {"m": {
        "prefill_base_s": 0.01, "prefill_per_token_s": 5e-5, "decode_step_base_s": 0.008,
        "decode_step_per_request_s": 4e-4, "kv_bytes_per_token": 131072, "link_bytes_per_s": 25e9,
        "block_size": 16, "samples": {"prefill": 50, "decode_step": 50, "min_samples": 8},
        **over}}}))
    return path


@pytest.mark.parametrize("flags, message", [
    # the router's default export has no KV size: a host tier of it would silently hold nothing
    (["--host-kv-gb", "64"], "--host-kv-gb 64: the calibration has no kv_bytes_per_token"),
    (["--kv-capacity-tokens", "0"], "--kv-capacity-tokens must be at least one KV block (16 tokens)"),
    (["--kv-capacity-tokens", "15"], "--kv-capacity-tokens must be at least one KV block"),
])
def test_kv_sizes_the_simulation_cannot_use_are_refused_before_it_runs(tmp_path, capsys, flags,
                                                                        message):
    record = write_record(tmp_path / "traffic.jsonl", n=10)
    calibration = write_calibration(tmp_path / "cal.json", kv_bytes_per_token=0.0)
    rc = main(["--record", str(record), "--calibration", str(calibration), "--slo-ttft-ms", "500",
               "--slo-tpot-ms", "30", "--instances", "2", "--quiet", *flags])
    captured = capsys.readouterr()
    assert rc == 2 and f"pd-planner: {message}" in captured.err and captured.out == ""


@pytest.mark.parametrize("flags, message", [
    (["--slo-ttft-ms", "0"], "--slo-ttft-ms must be a finite number > 0, got 0"),
    (["--slo-ttft-ms", "nan"], "--slo-ttft-ms must be a finite number > 0, got nan"),
    (["--slo-tpot-ms", "inf"], "--slo-tpot-ms must be a finite number > 0, got inf"),
    (["--slo-tpot-ms", "-5"], "--slo-tpot-ms must be a finite number > 0"),
    (["--rates", "1,x"], "--rates must be comma-separated numbers"),
    (["--rates", "1,nan"], "--rates must be finite and > 0 req/s, got nan"),
    (["--rates", "inf"], "--rates must be finite and > 0 req/s, got inf"),
    (["--rates", "2,0"], "--rates must be finite and > 0 req/s, got 0"),
    (["--instances", "1"], "--instances must be at least 2, got 1"),
    (["--max-instances", "1"], "--max-instances must be at least 2, got 1"),
    (["--target-rate", "inf"], "--target-rate must be a finite number > 0, got inf"),
    (["--duration", "nan"], "--duration must be at least"),
])
def test_flags_out_of_range_are_refused_naming_the_flag(tmp_path, capsys, flags, message):
    record = write_record(tmp_path / "traffic.jsonl", n=10)
    args = {"--record": str(record), "--slo-ttft-ms": "500", "--slo-tpot-ms": "30",
            "--instances": "2"}
    if "--target-rate" in flags or "--max-instances" in flags:
        del args["--instances"]
        args["--target-rate"] = "5"
    args.update(zip(flags[::2], flags[1::2]))
    with pytest.raises(SystemExit) as exit_:
        main([*(x for pair in args.items() for x in pair), "--quiet"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_outputs_that_cannot_be_written_are_reported_after_the_plan(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    record = write_record(tmp_path / "traffic.jsonl", n=10)
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the --json's directory would be
    rc = main(["--record", str(record), "--slo-ttft-ms", "500", "--slo-tpot-ms", "30",
               "--instances", "2", "--quiet", "--json", str(blocker / "plan.json"),
               "--plot", str(tmp_path / "split.xyz")])
    captured = capsys.readouterr()
    assert rc == 2 and "best split of 2 instances" in captured.out  # the plan itself is printed
    assert f"pd-planner: --json {blocker / 'plan.json'}: " in captured.err
    assert f"pd-planner: --plot {tmp_path / 'split.xyz'}: Format 'xyz' is not supported" in captured.err
    assert "Traceback" not in captured.err and not (tmp_path / "split.xyz").exists()
