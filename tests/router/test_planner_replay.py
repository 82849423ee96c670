"""bench/planner_replay.py's smallest variant: the planner benchmark's traffic replayed over HTTP
through pd-router in front of kv_both latency-modelled mocks, with Dynamo's rule applied every
interval through the admin API from the router's traffic record (the benchmark's own controller
process): a role moves while requests flow, and none is lost."""

from __future__ import annotations

import dataclasses

import pytest

from bench import planner_replay

pytestmark = pytest.mark.processes
SPAN_S = 24.0  # model seconds: one re-plan (at 15 s) while requests still arrive


def test_a_role_moves_over_http_and_no_request_is_lost(tmp_path):
    try:
        workload = planner_replay.compressed_workload(30.0)
    except FileNotFoundError as e:  # the benchmark's traffic is made from the shared traces
        pytest.skip(f"trace files not available: {e}")
    # code-phase requests (long prompts, short answers), spread evenly over SPAN_S: at the first
    # re-plan Dynamo's rule wants more prefill than the even split the deployment starts from
    code = [r for r in workload if r.arrival_s < SPAN_S][:400]
    requests = [dataclasses.replace(r, arrival_s=i * SPAN_S / len(code)) for i, r in enumerate(code)]
    assert planner_replay.dynamo_want(requests, planner_replay.INSTANCES).prefill > 2
    out = planner_replay.replayed(requests, "dynamo", 2, speedup=3.0, log_dir=tmp_path)
    assert out["requests"] == len(requests)
    assert out["controller_exit"] == 0
    assert out["lost"] == 0, out["errors"]
    assert out["moves"] >= 1, out["control"]
    # the router listed the moved worker in the prefill pool after the move
    assert out["split_log"][1][1] > 2, out["split_log"]
