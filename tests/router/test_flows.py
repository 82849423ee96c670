"""Each engine flow end to end through the router: the decode really got its KV from the prefill
the router chose (the mock decode checks the prompt digest its prefill registered)."""

import json
import time

import pytest
import requests

from tests.router.conftest import LONG_PROMPT, deployment, mocks, wait_until

FLOWS = [("vllm", "pull"), ("vllm", "push"), ("sglang", "pull")]


def sse_text(resp: requests.Response, chat: bool) -> str:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[6:])["choices"][0]
            out.append(choice["delta"].get("content", "") if chat else choice["text"])
    return "".join(out)


def answer_text(resp: requests.Response, chat: bool, stream: bool) -> str:
    assert resp.status_code == 200, resp.text
    if stream:
        assert resp.text.rstrip().endswith("data: [DONE]")
        return sse_text(resp, chat)
    choice = resp.json()["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


@pytest.mark.parametrize("engine, transfer", FLOWS)
def test_flow_streaming_and_not_chat_and_completions(engine, transfer):
    prefills, decodes = mocks(engine, push=transfer == "push")
    reference = mocks(engine)[1][0]  # an aggregated server answering on its own
    reference.role = "both"
    args = ("--engine", engine, "--transfer", transfer, "--policy", "round_robin", "--route-header", "full")
    with deployment(prefills, decodes, *args) as router:
        reference.start().wait_healthy(30)
        try:
            for chat in (False, True):
                path = "/v1/chat/completions" if chat else "/v1/completions"
                body = ({"messages": [{"role": "user", "content": LONG_PROMPT}]} if chat
                        else {"prompt": LONG_PROMPT})
                body.update(model="mock", max_tokens=7)
                expected = answer_text(requests.post(reference.url + path, json=body, timeout=10), chat, False)
                for stream in (False, True):
                    resp = requests.post(router.url + path, json={**body, "stream": stream}, timeout=20)
                    assert answer_text(resp, chat, stream) == expected
                    route = resp.headers["x-pd-route"]
                    assert f"prefill={prefills[0].url}" in route and f"decode={decodes[0].url}" in route
        finally:
            reference.stop()
        decode_stats, prefill_stats = decodes[0].stats(), prefills[0].stats()
        assert decode_stats["remote_decodes"] == 4 and decode_stats["mismatched_kv"] == 0
        assert prefill_stats["prefill_legs"] >= 4 and prefill_stats["rooms_held"] == 0
        metrics = router.metrics()
        assert 'pd_router_requests_total{decision="disaggregated",outcome="ok"} 4.0' in metrics
        assert "pd_router_ttft_seconds_count 2.0" in metrics


def test_push_prefill_answering_no_kv_transfer_params():
    """vLLM's push flow: a prefill's answer may carry `"kv_transfer_params": null` (its connector
    had none to give); the decode has the KV pushed all the same, and the request is served
    disaggregated (the router's hot path runs compiled here, its annotations checked)."""
    prefills, decodes = mocks(push=True, prefill_args=("--prefill-params-null",))
    with deployment(prefills, decodes, "--transfer", "push", "--policy", "round_robin",
                    "--route-header", "full") as router:
        for stream in (False, True):
            resp = requests.post(router.url + "/v1/completions", timeout=20, json={
                "model": "mock", "prompt": LONG_PROMPT, "max_tokens": 5, "stream": stream})
            assert answer_text(resp, False, stream)
            assert f"prefill={prefills[0].url}" in resp.headers["x-pd-route"]
        assert decodes[0].stats()["remote_decodes"] == 2 and prefills[0].stats()["prefill_legs"] == 2
        assert 'pd_router_requests_total{decision="disaggregated",outcome="ok"} 2.0' in router.metrics()


def test_short_prompt_is_prefilled_on_the_decode_worker():
    prefills, decodes = mocks()
    with deployment(prefills, decodes, "--policy", "prefix_cache", "--route-header", "full") as router:
        resp = requests.post(router.url + "/v1/completions",
                             json={"model": "mock", "prompt": "hi there", "max_tokens": 3}, timeout=10)
        assert resp.status_code == 200
        assert "prefill=local" in resp.headers["x-pd-route"]
        assert "uncached_length" in resp.headers["x-pd-route"]
        assert decodes[0].stats()["local"] == 1 and prefills[0].stats()["prefill_legs"] == 0


def test_sidecar_mode_uses_its_decode_and_chooses_the_prefill():
    prefills, decodes = mocks(prefills=2)
    with deployment(prefills, decodes, "--mode", "sidecar", "--policy", "least_loaded",
                    "--route-header", "full") as router:
        for _ in range(4):
            resp = requests.post(router.url + "/v1/completions",
                                 json={"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 3}, timeout=10)
            assert resp.status_code == 200 and "decode: sidecar" in resp.headers["x-pd-route"]
        assert sum(p.stats()["prefill_legs"] for p in prefills) >= 4
        assert decodes[0].stats()["remote_decodes"] == 4


def test_service_endpoints():
    prefills, decodes = mocks()
    with deployment(prefills, decodes) as router:
        assert requests.get(router.url + "/health", timeout=5).json() == {"status": "ok"}
        ready = requests.get(router.url + "/ready", timeout=5).json()
        assert ready["ready"] and ready["usable_prefill"] == 1
        models = requests.get(router.url + "/v1/models", timeout=5).json()["data"]
        assert [m["id"] for m in models] == ["mock"] and models[0]["max_model_len"] == 4096
        assert "pd_router_worker_healthy" in router.metrics()


def test_sglang_decodes_never_prefill_and_keep_the_conversation():
    """An SGLang decode in disaggregation mode serves PD requests only. A short prompt (vLLM:
    prefilled on the decode) and later turns (vLLM: append-prefill) go PD; the turns stay on the
    pinned decode, whose radix cache gives the prefill decode_prefix_len (SGLang's own
    mechanism), so only the new pages move."""
    prefills, decodes = mocks("sglang", decodes=2)
    with deployment(prefills, decodes, "--engine", "sglang", "--policy", "multi_turn",
                    "--route-header", "full") as router:
        routes, prompt = [], "hi there"
        for turn in range(3):
            resp = requests.post(router.url + "/v1/completions",
                                 json={"model": "mock", "prompt": prompt, "max_tokens": 3},
                                 headers={"x-session-id": "conv-1"}, timeout=10)
            assert resp.status_code == 200, resp.text
            routes.append(resp.headers["x-pd-route"])
            prompt += resp.json()["choices"][0]["text"] + " and more"
        assert all(f"prefill={prefills[0].url}" in route for route in routes), routes
        pinned = [d.url for d in decodes if f"decode={d.url}" in routes[0]]
        assert len(pinned) == 1 and all(f"decode={pinned[0]}" in route for route in routes)
        assert sum(d.stats()["local"] for d in decodes) == 0
        assert sum(d.stats()["remote_decodes"] for d in decodes) == 3


def test_sglang_without_a_prefill_worker_is_a_clear_503():
    prefills, decodes = mocks("sglang")
    with deployment(prefills, decodes, "--engine", "sglang", "--policy", "round_robin") as router:
        prefills[0].stop()
        down = f'pd_router_worker_healthy{{role="prefill",url="{prefills[0].url}"}} 0.0'

        def marked_down() -> bool:
            """Whether the router marked the prefill down; if not, a request meanwhile (it counts
            a failure against the prefill; its answer is a 503, or the mock decode's 409 when
            the decode's KV fetch from the dead prefill fails first)."""
            if down in router.metrics():
                return True
            requests.post(router.url + "/v1/completions",
                          json={"model": "mock", "prompt": "x", "max_tokens": 1}, timeout=10)
            return False

        wait_until(marked_down, what="prefill marked down")
        resp = requests.post(router.url + "/v1/completions",
                             json={"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 3},
                             timeout=10)
        assert resp.status_code == 503, resp.text
        assert "cannot prefill" in resp.json()["error"]["message"]


def test_streamed_tokens_reach_the_client_as_they_come_on_both_front_servers():
    # The decode's events are relayed from its connection's callback (stream_relay.py) on the
    # front server, and by the request's task on aiohttp's (a connection that asked for something
    # else first is aiohttp's from then on): on both, each token as it comes, not at the end.
    prefills, decodes = mocks(decode_args=("--tpot-ms", "100"))
    body = {"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 5, "stream": True}
    with deployment(prefills, decodes, "--policy", "round_robin") as router:
        reference = None
        with requests.Session() as session:
            for handed_over in (False, True):
                if handed_over:
                    assert session.get(router.url + "/v1/models", timeout=10).status_code == 200
                arrivals, lines = [], []
                with session.post(router.url + "/v1/completions", json=body, stream=True,
                                  timeout=20) as resp:
                    assert resp.status_code == 200
                    for line in resp.iter_lines():
                        if line.startswith(b"data: "):
                            arrivals.append(time.monotonic())
                            lines.append(line)
                text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
                assert lines[-1] == b"data: [DONE]" and len(lines) == 6
                assert reference is None or text == reference
                reference = text
                # 5 tokens 0.1 s apart: the first arrived well before the last
                assert arrivals[-2] - arrivals[0] > 0.25, (handed_over, arrivals)
        metrics = router.metrics()
        assert 'pd_router_requests_total{decision="disaggregated",outcome="ok"} 2.0' in metrics
        assert "pd_router_tpot_seconds_count 2.0" in metrics
