"""`make demo`: PD serving on CPU through pd-router.

Starts a tiny-model vLLM prefill server and decode server with PdNixlConnector (pull mode) and
pd-router in front of them, then sends a streaming completion and a 3-turn chat conversation
through the router. For each request it prints the answer, the router's route decision (x-pd-route)
and the router-measured TTFT, and checks the answer against the decode server serving the same
request on its own (aggregated).
"""

from __future__ import annotations

import json
import time

import requests

from pd_plugins.testing.engine_harness import VllmServer, metric_value, nixl_config, start_all
from pd_plugins.testing.processes import stop_servers_on_signals
from pd_plugins.testing.router_harness import RouterProcess
from pd_plugins.testing.tiny_models import ensure_tiny_model

COMPLETION = "the router sends a prompt to the prefill engine and the decode worker reads the cache block"
TURNS = [
    "how does a decode worker get the cache block from the prefill engine?",
    "and what happens when the prefill engine is busy?",
    "summarise the route of one request.",
]


def stream(router: RouterProcess, path: str, body: dict, session: str | None = None):
    """(text, token ids, x-pd-route, router-measured TTFT in ms) of one streamed request."""
    before = _ttft_totals(router)
    headers = {"x-session-id": session} if session else {}
    resp = requests.post(router.url + path, json={**body, "stream": True, "return_token_ids": True},
                         headers=headers, timeout=300)
    resp.raise_for_status()
    text, ids = [], []
    for line in resp.content.decode("utf-8").splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            ids += choice.get("token_ids") or []
    after = _ttft_totals(router)
    ttft_ms = (after[0] - before[0]) / max(1, after[1] - before[1]) * 1e3
    return "".join(text), ids, resp.headers.get("x-pd-route", ""), ttft_ms


def _ttft_totals(router: RouterProcess) -> tuple[float, float]:
    metrics = router.metrics()
    return (metric_value(metrics, "pd_router_ttft_seconds_sum"),
            metric_value(metrics, "pd_router_ttft_seconds_count"))


def aggregated_ids(decode: VllmServer, path: str, body: dict) -> list[int]:
    """The decode server's own answer to the same request (no transfer: it prefills itself)."""
    resp = requests.post(decode.url + path, json={**body, "return_token_ids": True}, timeout=300)
    resp.raise_for_status()
    return resp.json()["choices"][0]["token_ids"]


def report(label: str, text: str, route: str, ttft_ms: float, identical: bool) -> None:
    print(f"\n{label}")
    print(f"  output:     {text!r}")
    print(f"  route:      {route}")
    print(f"  TTFT:       {ttft_ms:.0f} ms (measured by pd-router)")
    print(f"  aggregated: {'identical' if identical else 'DIFFERENT'}")


def main() -> None:
    model = ensure_tiny_model("tiny-llama")
    print(f"model: {model} (tiny random-weight Llama, float32)")
    prefill = VllmServer("prefill", model, "0", nixl_config("prefill", "pull"))
    decode = VllmServer("decode", model, "1", nixl_config("decode", "pull"))
    # prefix_cache disaggregates every prompt of 16+ uncached tokens; the default policy would
    # prefill the demo's short prompts on the decode worker (fewer than 1024 uncached tokens:
    # moving their KV costs more than computing it there), and no KV would travel
    router = RouterProcess("router", prefill=[[prefill.url]], decode=[[decode.url]],
                           args=("--tokenizer", str(model), "--block-size", "32", "--log-format", "text",
                                 "--log-level", "warning", "--route-header", "full",
                                 "--policy", "prefix_cache"))
    print("starting vLLM prefill (core 0) and decode (core 1) with PdNixlConnector, then pd-router ...")
    started = time.monotonic()
    stop_servers_on_signals()  # `kill`, `timeout` or a closed terminal stop the servers too
    try:
        start_all([prefill, decode])
        start_all([router], timeout=120)
        print(f"ready in {time.monotonic() - started:.0f}s; pd-router on {router.url}; logs in {router.log_dir}")
        body = {"model": "tiny", "prompt": COMPLETION, "max_tokens": 24, "temperature": 0}
        text, ids, route, ttft = stream(router, "/v1/completions", body)
        report("streaming completion", text, route, ttft,
               ids == aggregated_ids(decode, "/v1/completions", body))

        messages: list[dict] = []
        for turn, question in enumerate(TURNS, 1):
            messages.append({"role": "user", "content": question})
            chat = {"model": "tiny", "messages": list(messages), "max_tokens": 16, "temperature": 0}
            text, ids, route, ttft = stream(router, "/v1/chat/completions", chat, session="demo-conversation")
            report(f"chat turn {turn}: {question!r}", text, route, ttft,
                   ids == aggregated_ids(decode, "/v1/chat/completions", chat))
            messages.append({"role": "assistant", "content": text})
        transfers = metric_value(decode.metrics(), "vllm:nixl_xfer_time_seconds_count")
        print(f"\nNIXL transfers counted by the decode server: {transfers:.0f}")
    finally:
        for server in (router, prefill, decode):
            server.stop()


if __name__ == "__main__":
    main()
