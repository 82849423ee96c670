"""pd-router's traffic record (routers/traffic_record.py) from a real router process on
pd-mock-engine: what each line says, rotation, the record read back as a workload, and the
requests in flight (GET /admin/in_flight) that pd-planner --apply adds to it."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import requests

from pd_plugins.perf.cluster_sim import SimConfig, simulate
from pd_plugins.perf.hardware import preset as hardware_preset
from pd_plugins.perf.replay import replay
from pd_plugins.perf.report import Slo
from pd_plugins.planner.live import Hysteresis, LivePlanner, RouterRoles, apply_once, read_traffic
from pd_plugins.routers.policy.scheduler import preset as policy_preset
from pd_plugins.workloads.traffic_record import load_traffic_record, rotated_paths
from tests.router.conftest import deployment, mocks, wait_until

MOCK_ARGS = ("--max-model-len", "16384")


def lines(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def complete(router, prompt, max_tokens, stream=True, **extra):
    return requests.post(router.url + "/v1/completions", timeout=30, json={
        "model": "mock", "prompt": prompt, "max_tokens": max_tokens, "stream": stream, **extra})


def test_record_says_what_was_routed_rejected_and_failed(tmp_path):
    path = tmp_path / "traffic.jsonl"
    # SLO admission: once the fit has 8 prefill legs (100 to 800 tokens at 0.25 ms a token),
    # 3000 tokens predict over 500 ms with nothing queued
    policy = msgspec.to_builtins(policy_preset("prefix_cache"))
    policy["admission"] = {"name": "slo", "params": {"ttft_slo_ms": 500}}
    prefills, decodes = mocks(prefill_args=(*MOCK_ARGS, "--prefill-ms-per-token", "0.25"),
                              decode_args=(*MOCK_ARGS, "--tpot-ms", "5"))
    config = {"policy": policy, "traffic_record": {"path": str(path), "max_block_keys": 4}}
    with deployment(prefills, decodes, config=config) as router:
        for i in range(8):  # the latency fit's samples (on its priors no prompt is refused)
            prompt = list(range(10_000 * (i + 1), 10_000 * (i + 1) + 100 * (i + 1)))
            assert complete(router, prompt, 1, stream=False).status_code == 200
        streamed = complete(router, list(range(1000, 1100)), 6, user="alice")
        assert streamed.status_code == 200
        _ = streamed.text
        whole = complete(router, list(range(2000, 2040)), 5, stream=False)
        assert whole.status_code == 200
        rejected = complete(router, list(range(3000)), 4)
        assert rejected.status_code == 429, rejected.text
        decodes[0].set_faults(fail_rate=1.0)
        failed = complete(router, list(range(5000, 5100)), 3)
        assert failed.status_code >= 500
        wait_until(lambda: path.exists() and len(lines(path)) == 12, timeout=10, what="12 records")
        metrics = router.metrics()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    records = lines(path)
    s, w, rej, fail = records[8:]  # each request ended before the next was sent
    assert s["input_tokens"] == 100 and s["output_tokens"] == 6 and s["status"] == 200
    # the model group's name: "" for a router without `models:`, whatever the client spelled
    assert s["decision"] == "disaggregated" and s["model"] == ""
    assert s["prefill"] == prefills[0].url and s["decode"] == decodes[0].url
    assert s["block_size"] == 16 and len(s["block_keys"]) == 4  # 6 full blocks, capped at 4
    assert 0 < s["ttft_s"] < s["e2e_s"] and s["tpot_s"] >= 0.004  # tokens 5 ms apart
    assert s["session"] == "alice"
    assert w["input_tokens"] == 40 and w["output_tokens"] == 5 and w["status"] == 200
    assert w["decision"] == "disaggregated" and w["e2e_s"] > 0 and w["ttft_s"] is None
    assert len(w["block_keys"]) == 2
    assert rej["decision"] == "rejected" and rej["status"] == 429 and rej["input_tokens"] == 3000
    assert "will not meet it" in rejected.text  # nothing queued: a retry cannot help
    assert rej["output_tokens"] == 4 and rej["ttft_s"] is None and rej["prefill"] is None
    assert fail["decision"] == "failed" and fail["status"] >= 500 and fail["e2e_s"] is None
    assert fail["decode"] == decodes[0].url
    assert s["t"] <= w["t"] <= rej["t"] <= fail["t"]
    text = path.read_text()
    assert "prompt" not in text and "1000, 1001" not in text  # no prompt, not even token ids
    assert 'pd_router_traffic_records_total{event="written"} 12.0' in metrics
    assert 'pd_router_traffic_records_total{event="dropped"} 0.0' in metrics


def test_record_rotates_and_reads_back_as_a_workload(tmp_path):
    path = tmp_path / "traffic.jsonl"
    prefills, decodes = mocks(prefill_args=MOCK_ARGS, decode_args=MOCK_ARGS)
    config = {"traffic_record": {"path": str(path), "max_bytes": 4096, "backups": 2}}
    shared = list(range(64))  # four 16-token blocks every prompt starts with
    with deployment(prefills, decodes, config=config) as router:
        for i in range(60):
            resp = complete(router, shared + [10_000 + i] * (20 + i), 2, stream=bool(i % 2))
            assert resp.status_code == 200
            _ = resp.text
        wait_until(lambda: 'event="written"} 60.0' in router.metrics(), timeout=10, what="60 written")
        metrics = router.metrics()
        reqs = load_traffic_record(path, with_rotated=True)
        # the replay reads a record as it reads a public trace (prompts from the block keys)
        replayed = asyncio.run(replay(router.url, reqs, 20.0, "mock", timeout_s=30)).outcomes
        assert [o.status for o in replayed] == ["ok"] * len(reqs), [o.error for o in replayed]
        assert [o.tokens for o in replayed] == [2] * len(reqs)
    files = rotated_paths(path)
    assert [os.path.basename(f) for f in files] == ["traffic.jsonl.2", "traffic.jsonl.1", "traffic.jsonl"]
    assert not os.path.exists(f"{path}.3")  # only `backups` are kept
    for f in files:
        assert os.path.getsize(f) <= 4096 and stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert 'pd_router_traffic_records_total{event="rotations"}' in metrics
    kept = len(reqs)
    assert 0 < kept < 60
    assert len(reqs) == kept and [r.request_id for r in reqs] == list(range(kept))
    assert all(r.block_tokens == 16 and r.arrival_s >= 0 for r in reqs)
    assert reqs == sorted(reqs, key=lambda r: r.arrival_s) and reqs[0].arrival_s == 0
    # the prompts: 64 shared tokens, then 20+i copies of one token: their tokens and sharing
    first_i = 60 - kept
    for k, r in enumerate(reqs):
        i = first_i + k
        assert r.input_tokens == 64 + 20 + i and r.output_tokens == 2
        assert len(r.block_hashes) == -(-r.input_tokens // 16)
        assert r.block_hashes[:4] == reqs[0].block_hashes[:4]  # the shared prefix
        assert r.block_hashes[4] != reqs[(k + 1) % kept].block_hashes[4]
    result = simulate(reqs, SimConfig(hardware_preset("llama-3.1-8b@h100"), 1, 1, block_tokens=16))
    assert [o.status for o in result.outcomes] == ["ok"] * kept
    # every prompt after the first finds the shared 64 tokens cached
    assert result.prompt_tokens_cached >= 64 * (kept - 1)


def test_requests_in_flight_are_listed_until_they_end_and_the_planner_plans_from_them(tmp_path):
    """GET /admin/in_flight lists what the record does not hold yet (same clock, block keys, no
    prompt), only with the admin token; `read_traffic` and `apply_once` plan from it."""
    path, token, n = tmp_path / "traffic.jsonl", "in-flight-token", 8
    prefills, decodes = mocks(prefill_args=MOCK_ARGS, decode_args=(*MOCK_ARGS, "--tpot-ms", "40"))
    config = {"traffic_record": {"path": str(path), "max_block_keys": 4}}

    def listing(router, headers=None, query=""):
        return requests.get(router.url + "/admin/in_flight" + query, timeout=10,
                            headers={"Authorization": f"Bearer {token}"} if headers is None else headers)

    def stream(router, i):  # 250 output tokens at 40 ms: 10 s in flight
        resp = requests.post(router.url + "/v1/completions", timeout=60, stream=True, json={
            "model": "mock", "prompt": list(range(100)) + [i] * 20, "max_tokens": 250, "stream": True})
        return resp.status_code, resp.text

    with deployment(prefills, decodes, config=config, env={"PD_ROUTER_ADMIN_TOKEN": token}) as router, \
            ThreadPoolExecutor(n) as pool:
        sent = time.time()
        answers = [pool.submit(stream, router, i) for i in range(n)]
        # every request streaming, none ended: the record holds none of them
        wait_until(lambda: sum(e["phase"] == "answer" and e["output_tokens"] >= 3
                               for e in listing(router).json()["requests"]) == n,
                   timeout=20, what=f"{n} requests streaming")
        body = listing(router).json()
        assert body["total"] == n and len(body["requests"]) == n and not lines(path)
        assert sent <= body["requests"][0]["t"] <= body["now"] <= time.time()
        for e in body["requests"]:
            assert e["model"] == "" and e["input_tokens"] == 120 and e["max_tokens"] == 250
            assert e["block_size"] == 16 and len(e["block_keys"]) == 4  # 7 full blocks, capped
            assert 3 <= e["output_tokens"] < 250
        assert len({tuple(e["block_keys"]) for e in body["requests"]}) == 1  # the shared prefix
        assert "prompt" not in listing(router).text
        oldest = [e["t"] for e in listing(router, query="?limit=3").json()["requests"]]
        assert oldest == sorted(e["t"] for e in body["requests"])[:3]
        assert listing(router, query="?model=other").json()["total"] == 0
        assert listing(router, query="?limit=0").status_code == 400
        # the admin token, as every /admin route
        assert listing(router, headers={}).status_code == 401
        assert listing(router, headers={"Authorization": "Bearer wrong"}).status_code == 403
        # pd-planner --apply's view: the window's arrivals and the work in flight
        roles = RouterRoles(router.url, token)
        traffic = read_traffic(roles, str(path), window_s=60)
        # every one streams: prompt prefilled, so an answer in progress, none waiting for a prefill
        assert len(traffic.window) == n and len(traffic.decoding) == n and traffic.in_flight == []
        assert all(r.input_tokens == 120 and r.output_tokens == 250 for r in traffic.window)
        # what each still lacks, its prompt (the KV it holds) kept, as left_to_do in the simulator
        assert all(1 <= r.output_tokens <= 247 and r.input_tokens == 120 for r in traffic.decoding)
        planner = LivePlanner(Slo(1.0, 0.05), SimConfig(hardware_preset("llama-3.1-8b@h100")), "round_robin",
                              window_s=60, interval_s=30, hysteresis=Hysteresis(min_requests=n))
        said: list[str] = []
        decision = apply_once(planner, roles, traffic.window, traffic.now_s, dry_run=True,
                              say=said.append, in_flight=traffic.in_flight,
                              decoding=traffic.decoding)
        assert decision is not None and decision.scores, said  # it simulated the window
        assert f"{n} requests in the window, {n} in flight ({n} answering)" in said[0], said
        # the command line, once: the same two sources
        cli = subprocess.run(
            [sys.executable, "-m", "pd_plugins.planner", "--apply", router.url, "--record", str(path),
             "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50", "--policy", "round_robin",
             "--window-s", "60", "--once", "--dry-run"],
            capture_output=True, text=True, timeout=120, env={**os.environ, "PD_ROUTER_ADMIN_TOKEN": token})
        assert cli.returncode == 0 and f"{n} requests in the window, {n} in flight" in cli.stdout, \
            cli.stdout + cli.stderr
        assert [a.result(timeout=60)[0] for a in answers] == [200] * n
        # ended: gone from the list, in the record
        wait_until(lambda: listing(router).json()["total"] == 0 and len(lines(path)) == n,
                   timeout=10, what="the requests to end")
        traffic = read_traffic(roles, str(path), window_s=60)
        assert len(traffic.window) == n and traffic.in_flight == [] and traffic.decoding == []
        assert all(r.output_tokens == 250 for r in traffic.window)
