"""pd-mock-engine --latency-model: answers timed by the engine model on an accelerated clock, its
prefix cache, its /metrics, its PD legs and its vLLM KV events (read by the router's own
KvEventSubscriber into a PrefixIndex)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest
import requests

from pd_plugins.perf.engine_model import EngineInstance, EngineRequest
from pd_plugins.perf.hardware import preset
from pd_plugins.perf.replay import replay
from pd_plugins.routers.health import parse_engine_metrics
from pd_plugins.routers.kv_sources.events import KvEventSubscriber
from pd_plugins.routers.policy.prefix_index import PrefixIndex
from pd_plugins.vocab.block_keys import block_keys
from pd_plugins.vocab.transfer_params import PdSection, pd_section_of
from pd_plugins.testing.engine_harness import start_all
from pd_plugins.testing.processes import free_port
from pd_plugins.testing.router_harness import MockEngineProcess
from pd_plugins.workloads import TraceRequest, prompt_token_ids
from tests.router.conftest import wait_until

PRESET = "llama-3.1-8b@h100"
HW = preset(PRESET)
SPEEDUP = 20
MODELLED = ("--latency-model", PRESET, "--speedup", str(SPEEDUP), "--max-model-len", "65536")


def trace(tokens: int, output: int, *block_ids: int) -> TraceRequest:
    """A request whose 512-token blocks are `block_ids` (equal ids: equal token blocks)."""
    assert len(block_ids) == -(-tokens // 512)
    return TraceRequest(0, 0.0, tokens, output, tuple(block_ids))


@contextlib.contextmanager
def running(*procs):
    try:
        start_all(list(procs), timeout=60)
        yield procs
    finally:
        for proc in procs:
            proc.stop(grace=5)


def alone(req: TraceRequest) -> EngineRequest:
    """The same request through an EngineInstance driven by itself (no HTTP, no clock)."""
    inst = EngineInstance(HW, block_size=16)
    ereq = EngineRequest("a", req.input_tokens, req.output_tokens,
                         block_keys(prompt_token_ids(req), 16), "local")
    inst.submit(ereq, 0.0)
    now = 0.0
    while (d := inst.plan(now)) is not None:
        now += d
        inst.finish(now)
    return ereq


def send(url: str, req: TraceRequest):
    return asyncio.run(replay(url, [req], SPEEDUP, "mock", timeout_s=30)).outcomes[0]


def test_local_request_is_timed_as_the_engine_model_times_it():
    mock = MockEngineProcess("modelled", args=MODELLED)
    tries = []
    with running(mock):
        assert send(mock.url, trace(1000, 5, 1, 2)).status == "ok"  # warm the connection up
        # Every wall ms of HTTP or of a busy host counts 20 model ms: the best of up to three
        # requests (each with a new prompt, so each is prefilled in full) is the one to compare.
        for attempt in range(3):
            req = trace(32_000, 300, *range(100 * attempt, 100 * attempt + 63))
            expected = alone(req)
            tries.append(send(mock.url, req))
            if tries[-1].status == "ok" and tries[-1].ttft_s <= expected.first_token_at * 1.05 \
                    and tries[-1].e2e_s <= expected.finished_at * 1.05:
                break
        stats = mock.stats()
    # by hand: four chunks of the 8192-token budget, then 299 decode steps
    chunks = [(8192, 0), (8192, 8192), (8192, 16384), (32_000 - 24576, 24576)]
    assert expected.first_token_at == pytest.approx(sum(HW.step_s([c]) for c in chunks))
    assert all(o.status == "ok" and o.tokens == 300 and not o.disaggregated for o in tries)
    ttft, e2e = min(o.ttft_s for o in tries), min(o.e2e_s for o in tries)
    # HTTP adds a little, it never takes away
    assert expected.first_token_at * 0.99 <= ttft <= expected.first_token_at * 1.10
    assert expected.finished_at * 0.99 <= e2e <= expected.finished_at * 1.10
    tpot = (expected.finished_at - expected.first_token_at) / 299
    assert min(o.tpot_s for o in tries) == pytest.approx(tpot, rel=0.1)
    assert stats["prefill_tokens_computed"] == 1000 + 32_000 * len(tries)
    assert stats["steps"] >= 4 + (4 + 299) * len(tries)


def test_shared_prefix_is_cached_and_metrics_show_what_runs():
    mock = MockEngineProcess("modelled", args=MODELLED)
    with running(mock):
        assert send(mock.url, trace(1024, 4, 7, 8)).status == "ok"
        assert mock.stats()["prompt_tokens_cached"] == 0
        assert send(mock.url, trace(1024, 4, 7, 9)).status == "ok"  # the same first 512 tokens
        assert mock.stats()["prompt_tokens_cached"] == 512

        def metrics():
            return parse_engine_metrics(requests.get(mock.url + "/metrics", timeout=5).text, "vllm")

        # idle: nothing waits or runs, and KV usage is 0 although its prefix cache holds blocks
        # (vLLM counts evictable cached blocks as free)
        assert metrics() == (0, 0, 0.0) and mock.stats()["prompt_tokens_cached"] == 512
        # ~20000 decode steps: minutes of model time, many wall seconds; the client leaves early
        body = {"prompt": prompt_token_ids(trace(512, 1, 10)), "max_tokens": 20_000, "stream": True}
        resp = requests.post(mock.url + "/v1/completions", json=body, stream=True, timeout=10)
        lines = resp.iter_lines()
        assert next(lines).startswith(b"data: ")
        waiting, running_, usage = metrics()
        assert running_ == 1 and waiting == 0
        steps = mock.stats()["steps"]
        resp.close()
        started = time.monotonic()
        wait_until(lambda: metrics()[1] == 0, timeout=5, what="the aborted request to leave")
        assert time.monotonic() - started < 5
        assert mock.stats()["steps"] - steps < 2000  # aborted, not run to its end


def test_pd_legs_pin_prefill_kv_until_the_decode_reads_it():
    prefill = MockEngineProcess("prefill", role="prefill", args=MODELLED)
    decode = MockEngineProcess("decode", role="decode", args=MODELLED)
    with running(prefill, decode):
        ids = prompt_token_ids(trace(1024, 1, 20, 21))
        other = prompt_token_ids(trace(1024, 1, 22, 23))

        def prefill_leg(prompt):
            resp = requests.post(prefill.url + "/v1/completions", timeout=10, json={
                "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            assert resp.status_code == 200, resp.text
            return resp.json()["kv_transfer_params"]

        params = prefill_leg(ids)
        section = pd_section_of(params)  # the router's own reader
        assert section == PdSection(prompt_tokens=1024, cached_tokens=0, engine_id=params["remote_engine_id"],
                                    mode="pull", block_size=16)
        assert prefill.stats()["rooms_held"] == 1
        pinned = prefill.stats()["kv_usage"]
        wrong = requests.post(decode.url + "/v1/completions", timeout=10, json={
            "prompt": other, "max_tokens": 3, "kv_transfer_params": params})
        assert wrong.status_code == 409

        params = prefill_leg(ids)  # the first leg's blocks are cached now
        assert pd_section_of(params).cached_tokens == 1023  # all but the last token, as vLLM
        resp = requests.post(decode.url + "/v1/completions", timeout=10, json={
            "prompt": ids, "max_tokens": 3, "kv_transfer_params": params})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"] == {"prompt_tokens": 1024, "completion_tokens": 3, "total_tokens": 1027}
        stats = decode.stats()
        assert stats["transfer_tokens"] == 1024 and stats["transfer_bytes"] == HW.kv_bytes(1024)
        assert stats["remote_decodes"] == 2 and stats["mismatched_kv"] == 1
        wait_until(lambda: prefill.stats()["rooms_held"] == 0, timeout=5, what="the transfers read")
        assert prefill.stats()["kv_usage"] < pinned  # the private blocks of both legs are free
        assert prefill.stats()["prefill_tokens_computed"] == 1024 + 1


def test_kv_events_feed_the_router_prefix_index_and_oversized_requests_fail():
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    # 2048 tokens of KV: two 1000-token prompts fit, a third evicts the oldest
    mock = MockEngineProcess("events", args=(*MODELLED, "--kv-events", endpoint,
                                             "--kv-capacity-tokens", "2048"))

    async def scenario() -> None:
        index = PrefixIndex()
        sub = KvEventSubscriber(index, mock.url, endpoint)
        task = asyncio.create_task(sub.run())
        try:
            async with aiohttp.ClientSession() as http:
                async def complete(prompt) -> int:
                    async with http.post(mock.url + "/v1/completions",
                                         json={"prompt": prompt, "max_tokens": 2}) as resp:
                        await resp.read()
                        return resp.status

                async def matched(keys) -> int:
                    deadline = time.monotonic() + 3
                    while index.matched_blocks(mock.url, keys) < len(keys) and time.monotonic() < deadline:
                        await asyncio.sleep(0.02)
                    return index.matched_blocks(mock.url, keys)

                await asyncio.sleep(0.3)  # a SUB misses what is published before it connects
                for attempt in range(5):  # ... so retry with a fresh prompt if it did
                    first = prompt_token_ids(trace(1000, 2, 1000 + attempt, 2000 + attempt))
                    keys = block_keys(first, 16)
                    assert await complete(first) == 200
                    if await matched(keys) == len(keys):
                        break
                assert len(keys) == 62 and index.matched_blocks(mock.url, keys) == 62
                assert index.matched_blocks(mock.url, block_keys(first[:512] + [1] * 488, 16)) == 32
                # a prompt on a cached prefix: its new blocks come chained on the last cached one
                grown = prompt_token_ids(trace(1000, 2, 1000 + attempt, 3000))
                assert grown[:512] == first[:512] and await complete(grown) == 200
                assert await matched(block_keys(grown, 16)) == 62
                for blocks in ((30, 31), (32, 33)):
                    later = prompt_token_ids(trace(1000, 2, *blocks))
                    assert await complete(later) == 200
                assert await matched(block_keys(later, 16)) == 62
                deadline = time.monotonic() + 3
                while index.matched_blocks(mock.url, keys) and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert index.matched_blocks(mock.url, keys) == 0  # evicted: BlockRemoved arrived
                too_big = prompt_token_ids(trace(3000, 2, 40, 41, 42, 43, 44, 45))
                async with http.post(mock.url + "/v1/completions",
                                     json={"prompt": too_big, "max_tokens": 2}) as resp:
                    assert resp.status == 400
                    assert "more than this instance's 2048" in (await resp.json())["error"]["message"]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    with running(mock):
        asyncio.run(scenario())
        stats = mock.stats()
        assert stats["evicted_blocks"] > 0 and stats["kv_events_sent"] > 0


def test_mock_output_ids_are_cached_for_the_next_turn():
    """A conversation's second turn finds its first turn's prompt AND answer in the cache, when
    the replay tells the mock which tokens that answer was (`mock_output_ids`)."""
    from pd_plugins.workloads import ConversationSpec, generate_conversations
    spec = ConversationSpec(session_rate_per_s=1.0, mean_turns=50, max_turns=2, shared_system_tokens=0,
                            user_tokens_range=(300, 600), assistant_tokens_range=(200, 400),
                            think_time_median_s=0.5, think_time_sigma=0.1)
    turns = [r for r in generate_conversations(spec, 1, seed=2)]
    assert [r.turn for r in turns] == [0, 1]
    first, second = turns
    for with_outputs, expect in ((False, first.input_tokens // 16 * 16),
                                 (True, (first.input_tokens + first.output_tokens) // 16 * 16)):
        mock = MockEngineProcess("modelled", args=MODELLED)
        with running(mock):
            result = asyncio.run(replay(mock.url, turns, SPEEDUP, "mock", timeout_s=30,
                                        mock_outputs=with_outputs))
            assert [o.status for o in result.outcomes] == ["ok", "ok"]
            assert mock.stats()["prompt_tokens_cached"] == expect, with_outputs
