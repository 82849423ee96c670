"""bench/fast_engine.py: the router benchmark's default engines answer each PD protocol as the
routers need (a vLLM prefill's kv_transfer_params, an SGLang decode held until its room's
prefill, a stream's end), and pd-router serves both flows through them."""

from __future__ import annotations

import threading

import pytest
import requests

from bench import router_overhead as ro
from pd_plugins.testing.router_harness import MockEngineProcess, RouterProcess

pytestmark = pytest.mark.processes


@pytest.fixture
def engines(tmp_path):
    ends = tuple(MockEngineProcess(f"fast-{engine}-{role}", role=role, engine=engine, log_dir=tmp_path)
                 for engine in ("vllm", "sglang") for role in ("prefill", "decode"))
    fast = ro.FastEngineProcess("fast-engines", ends=ends, log_dir=tmp_path)
    fast.start()
    try:
        fast.wait_healthy(30)
        yield dict(zip(("vp", "vd", "sp", "sd"), ends))
    finally:
        fast.stop()


def post(url: str, body: dict, timeout: float = 5) -> requests.Response:
    return requests.post(url + "/v1/completions", json=body, timeout=timeout)


def test_each_engine_answers_its_protocol(engines):
    vp, vd, sp, sd = engines["vp"], engines["vd"], engines["sp"], engines["sd"]
    prefill = post(vp.url, {"prompt": "x", "max_tokens": 1,
                            "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = prefill["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_engine_id"] and params["remote_block_ids"]
    whole = post(vd.url, {"prompt": "x", "max_tokens": 3}).json()
    assert whole["usage"]["completion_tokens"] == 3 and whole["choices"][0]["text"]
    streamed = post(vd.url, {"prompt": "x", "max_tokens": 3, "stream": True})
    events = [line for line in streamed.text.split("\n\n") if line]
    assert streamed.headers["Content-Type"] == "text/event-stream"
    assert len(events) == 4 and events[-1] == "data: [DONE]"
    chat = requests.post(vd.url + "/v1/chat/completions", json={"messages": [], "max_tokens": 2},
                         timeout=5).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"]
    metrics = requests.get(vp.url + "/metrics", timeout=5).text
    assert "vllm:num_requests_running" in metrics and "sglang:num_running_reqs" in metrics

    # an SGLang decode answers once its room's prefill has, not before
    answered: list[requests.Response] = []
    waiter = threading.Thread(target=lambda: answered.append(
        post(sd.url, {"prompt": "x", "max_tokens": 2, "bootstrap_room": 7})))
    waiter.start()
    waiter.join(0.5)
    assert not answered, "the decode answered before its prefill"
    assert post(sp.url, {"prompt": "x", "bootstrap_room": 8}).status_code == 200  # another room
    waiter.join(0.3)
    assert not answered
    assert post(sp.url, {"prompt": "x", "bootstrap_room": 7}).status_code == 200
    waiter.join(5)
    assert answered and answered[0].status_code == 200
    # a prefill first: its decode answers at once
    assert post(sd.url, {"prompt": "x", "max_tokens": 2, "bootstrap_room": 8}, timeout=2).ok


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_pd_router_serves_both_modes_through_them(engines, engine, tmp_path):
    prefill, decode = (engines["vp"], engines["vd"]) if engine == "vllm" else (engines["sp"], engines["sd"])
    flags = ("--engine", engine, *(("--transfer", "pull") if engine == "vllm" else ()),
             "--policy", "round_robin")
    router = RouterProcess(f"pd-router-{engine}", prefill=[prefill.worker_arg()],
                           decode=[decode.worker_arg()], args=flags, config=ro.PD_ROUTER_CONFIG,
                           log_dir=tmp_path)
    router.start()
    try:
        router.wait_healthy(60)
        for stream in (False, True):
            answer = requests.post(router.url + "/v1/completions", data=ro.BODIES[stream],
                                   headers=ro.HEADERS, timeout=10)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-pd-route"] == "route=disaggregated"
            assert answer.text.endswith("data: [DONE]\n\n") if stream else answer.json()["choices"]
    finally:
        router.stop()
