"""Verified KV hand-off, the router's side (issue 28, docs/plans/kv-verification.md §5), against
pd-mock-engine decodes that report verdicts as a verifying connector does: the verdict in the full
x-pd-route and in pd_router_kv_verdicts_total, and a decode whose mismatch counter rises taken out
of rotation for quarantine_s (probes pass meanwhile) and back after it."""

from __future__ import annotations

import re
import time

import requests

from tests.router.conftest import FAST_HEALTH, LONG_PROMPT, deployment, mocks, wait_until

QUARANTINE_S = 3.0


def verdicts(router) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'pd_router_kv_verdicts_total\{verdict="(\w+)"\} (\S+)', router.metrics())}



def test_verdicts_reach_header_and_metric_and_a_mismatching_decode_is_quarantined():
    prefills, decodes = mocks(decodes=2)
    decodes[0].args = ("--kv-verdict", "verified", "--kv-mismatch-match", "kvfault-")
    decodes[1].args = ("--kv-verdict", "verified")
    health = {**FAST_HEALTH, "kv_verify": {"failures": 2, "window_s": 30,
                                           "quarantine_s": QUARANTINE_S}}
    with deployment(prefills, decodes, "--policy", "round_robin",
                    config={"health": health, "route_header": "full"}) as router:
        ready = lambda: requests.get(router.url + "/ready", timeout=5).json()  # noqa: E731
        seen: dict[str, int] = {}
        for i in range(8):  # round robin: both decodes, d0 answering `recomputed`
            resp = requests.post(router.url + "/v1/completions", timeout=30, json={
                "model": "mock", "prompt": f"kvfault-{i} " + LONG_PROMPT, "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            route = resp.headers["x-pd-route"]
            assert "prefill=local" not in route, route
            expected = "recomputed" if f"decode={decodes[0].url}," in route else "verified"
            assert f", kv={expected}," in route, route
            seen[expected] = seen.get(expected, 0) + 1
            if ready()["usable_decode"] == 1:
                break
        assert seen.get("recomputed", 0) >= 2 and seen.get("verified", 0) >= 1, seen
        assert verdicts(router) == {k: float(v) for k, v in seen.items()}
        # d0's counter rose by 2: out of rotation (its probes keep passing meanwhile)
        wait_until(lambda: ready()["usable_decode"] == 1, 5, "the mismatching decode to go out")
        out_at = time.monotonic()
        for i in range(3):
            resp = requests.post(router.url + "/v1/completions", timeout=30, json={
                "model": "mock", "prompt": f"kvfault-after-{i} " + LONG_PROMPT, "max_tokens": 2})
            assert f"decode={decodes[1].url}, kv=verified" in resp.headers["x-pd-route"]
        assert f'pd_router_worker_healthy{{role="decode",url="{decodes[0].url}"}} 0.0' \
            in router.metrics()
        wait_until(lambda: ready()["usable_decode"] == 2, QUARANTINE_S + 5, "its return")
        assert time.monotonic() - out_at >= QUARANTINE_S - 1.0  # not brought back by a probe
        assert 'pd_router_kv_quarantine_events_total{event="quarantined_decode"} 1.0' \
            in router.metrics()


def test_a_prefill_whose_kv_mismatches_at_two_decodes_is_quarantined():
    prefills, decodes = mocks(prefills=2, decodes=3)
    prefills[0].args = ("--engine-id", "badp")
    for d in decodes:
        d.args = ("--kv-verdict", "verified", "--kv-mismatch-from", "badp")
    # failures out of reach: only the attribution from verdicts can take a worker out here
    health = {**FAST_HEALTH, "kv_verify": {"failures": 1000, "window_s": 30,
                                           "quarantine_s": QUARANTINE_S}}
    with deployment(prefills, decodes, "--policy", "round_robin",
                    config={"health": health, "route_header": "full"}) as router:
        ready = lambda: requests.get(router.url + "/ready", timeout=5).json()  # noqa: E731
        blamed_by = set()
        for i in range(12):
            resp = requests.post(router.url + "/v1/completions", timeout=30, json={
                "model": "mock", "prompt": f"{i} " + LONG_PROMPT, "max_tokens": 2})
            route = resp.headers["x-pd-route"]
            bad = f"prefill={prefills[0].url}," in route
            assert (", kv=recomputed," if bad else ", kv=verified,") in route, route
            if bad:
                blamed_by.add(route.split("decode=", 1)[1].split(",", 1)[0])
            if ready()["usable_prefill"] == 1:
                break
        assert len(blamed_by) == 2, blamed_by  # out at the second decode's verdict, not before
        assert ready()["usable_decode"] == 3
        resp = requests.post(router.url + "/v1/completions", timeout=30, json={
            "model": "mock", "prompt": "after " + LONG_PROMPT, "max_tokens": 2})
        assert f"prefill={prefills[1].url}," in resp.headers["x-pd-route"]
        wait_until(lambda: ready()["usable_prefill"] == 2, QUARANTINE_S + 5, "its return")
        events = router.metrics()
        assert 'pd_router_kv_quarantine_events_total{event="quarantined_prefill"} 1.0' in events
        assert 'pd_router_kv_quarantine_events_total{event="quarantined_decode"} 0.0' in events
