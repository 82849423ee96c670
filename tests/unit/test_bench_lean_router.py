"""bench/lean_router.py: pd-router's per-request work on the floor proxy's I/O still runs pd-router's
flow through pd-router's own objects (it reaches into them, so a change there must not leave the
bench's row measuring something else or nothing)."""

from __future__ import annotations

import re

import pytest
import requests

from bench import router_overhead as ro
from pd_plugins.testing.router_harness import MockEngineProcess

pytestmark = pytest.mark.processes
IN_FLIGHT = re.compile(r'^pd_router_worker_in_flight\{[^}]*\} (\S+)$', re.M)


def test_the_lean_router_runs_the_pull_flow_with_pd_routers_accounting_and_route_header(tmp_path):
    prefill = MockEngineProcess("lean-prefill", role="prefill", log_dir=tmp_path)
    decode = MockEngineProcess("lean-decode", role="decode", log_dir=tmp_path)
    lean = None
    try:
        for mock in (prefill, decode):
            mock.start()
        for mock in (prefill, decode):
            mock.wait_healthy(60)
        lean = ro.LeanRouterProcess("lean-router", prefill=[prefill.worker_arg()],
                                    decode=[decode.worker_arg()],
                                    args=("--engine", "vllm", "--transfer", "pull", "--policy",
                                          "round_robin"),
                                    config=ro.PD_ROUTER_CONFIG, log_dir=tmp_path)
        assert "bench.lean_router" in lean.command()
        lean.start()
        lean.wait_healthy(60)
        answers = [requests.post(lean.url + "/v1/completions", data=ro.BODIES[False],
                                 headers=ro.HEADERS, timeout=10) for _ in range(3)]
        for answer in answers:
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"]
            assert answer.headers["x-pd-route"] == "route=disaggregated"
        # both legs, as pd-router's pull flow sends them: the prefill cut to one token with the
        # remote-decode flags, the decode with the prefill's own kv_transfer_params
        prefill_legs, decode_legs = prefill.bodies(), decode.bodies()
        assert len(prefill_legs) == len(decode_legs) == 3
        assert all(leg["max_tokens"] == 1 and leg["kv_transfer_params"]["do_remote_decode"]
                   for leg in prefill_legs)
        assert all(leg["kv_transfer_params"]["remote_engine_id"] and leg["max_tokens"] == ro.MAX_TOKENS
                   for leg in decode_legs)
        # the request's end as pd-router's (Proxy._finish, the accounting): counted, nothing held
        metrics = lean.metrics()
        served = ro.pd_router_decisions(ro.Target("lean", "lean", lean.url, lean))
        assert (served["disaggregated"], served.get("local", 0)) == (3, 0)
        held = [float(v) for v in IN_FLIGHT.findall(metrics)]
        assert len(held) == 2 and not any(held), metrics
        bad = requests.post(lean.url + "/v1/completions", data=b"{not json", headers=ro.HEADERS,
                            timeout=10)
        assert bad.status_code == 400  # pd-router's request checks ran
    finally:
        if lean is not None:
            lean.stop()
        for mock in (prefill, decode):
            mock.stop()
