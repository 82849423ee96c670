"""pd-router learning a real vLLM server's prefix cache from its KV events (ZMQ)."""

from __future__ import annotations

import json
import time

import pytest
import requests

from pd_plugins.testing.engine_harness import VllmServer, start_all
from pd_plugins.testing.processes import free_port
from pd_plugins.testing.router_harness import RouterProcess
from tests.e2e.deployments import PROMPTS, completion_body, model_path, output_ids, token_prompt

pytestmark = pytest.mark.e2e


def post(router, path, body, timeout=180):
    return requests.post(router.url + path, json=body, timeout=timeout)


def wait_for_kv_events(router, attempts: int = 20) -> None:
    """ZMQ drops what a publisher sends before its connection is up (vLLM connects to the router's
    bound endpoint, retrying), and a repeated prompt publishes nothing new: so first make sure
    events flow, with throwaway prompts, before the one the test measures."""
    for i in range(attempts):
        throwaway = token_prompt(100, seed=9100 + i)
        post(router, "/v1/completions", completion_body(throwaway))
        time.sleep(0.5)
        route = post(router, "/v1/completions", completion_body(throwaway)).headers["x-pd-route"]
        if "uncached 4 <" in route:
            return
    raise AssertionError(f"no KV events reached the router after {attempts} prompts: {route}")


def test_prefix_index_follows_real_vllm_kv_events(references, pool):
    """A vLLM server publishing KV events over ZMQ: the router learns from them which prompt blocks
    it holds (in exact mode the router records nothing itself), so a repeated prompt is prefilled
    on the decode worker and a new one is not."""
    pool.discard()  # an idle NIXL pair keeps both cores busy: a server starting beside it starves
    port = free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
    server = VllmServer("decode-kv-events", model_path("tiny-llama"), "1",
                        extra_args=("--kv-events-config", json.dumps(events)))
    # vLLM connects to a non-wildcard endpoint, so the router binds it (loopback only).
    router = RouterProcess("router-events", decode=[[server.url, f"kv_events=bind:tcp://127.0.0.1:{port}"]],
                           args=("--policy", "prefix_cache", "--block-size", "32", "--log-format", "text",
                                 "--route-header", "full"),
                           config={"health": {"interval_s": 30}})
    try:
        start_all([server], timeout=600)
        start_all([router], timeout=120)
        wait_for_kv_events(router)
        prompt = PROMPTS[100]  # 3 full blocks of 32 + 4 tokens
        first = post(router, "/v1/completions", completion_body(prompt))
        assert output_ids(first) == references["tiny-llama"][tuple(prompt)]
        assert "no usable prefill worker" in first.headers["x-pd-route"]  # the decider said go
        route = ""
        for _ in range(50):  # events arrive asynchronously
            route = post(router, "/v1/completions", completion_body(prompt)).headers["x-pd-route"]
            if "uncached 4 <" in route:
                break
        assert "uncached 4 < 16 tokens" in route, route
        other = post(router, "/v1/completions", completion_body(PROMPTS[150]))
        assert "uncached_length" not in other.headers["x-pd-route"]  # nothing of it cached
    finally:
        router.stop()
        server.stop()
