"""The mock engine in process: its PD legs (the typed `pd` section, the 409 of a wrong prompt's
KV), its load metrics, streaming faults; both timings run the same code."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import msgspec
from aiohttp import web

from pd_plugins.mock.engine import MockEngine, build_parser
from pd_plugins.mock.experts import mock_expert_signature
from pd_plugins.routers.health import parse_engine_metrics
from pd_plugins.testing.processes import free_port
from pd_plugins.vocab.expert_signature import ExpertSignature
from pd_plugins.vocab.transfer_params import PdSection, pd_section_of, prefill_flags

PROMPT = list(range(100))
OTHER = list(range(1, 101))


@contextlib.asynccontextmanager
async def mock(*flags: str):
    """A mock engine on free ports: (its URL, the MockEngine)."""
    port, side_port = free_port(), free_port()
    args = build_parser().parse_args(["--port", str(port), "--side-port", str(side_port), *flags])
    engine = MockEngine(args)
    app, side = engine.apps()
    runners = []
    for application, at in ((app, port), (side, side_port)):
        runner = web.AppRunner(application, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", at).start()
        runners.append(runner)
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        for runner in runners:
            await runner.cleanup()


async def post(http: aiohttp.ClientSession, url: str, body: dict, **headers: str):
    async with http.post(url + "/v1/completions", json={"max_tokens": 3, **body}, headers=headers) as resp:
        return resp.status, await resp.read()


def test_prefill_answers_a_full_pd_section_that_the_router_reads():
    async def scenario():
        async with mock("--role", "prefill", "--engine-id", "p0", "--moe-experts", "2,16") as (url, _), \
                aiohttp.ClientSession() as http:
            status, raw = await post(http, url, {"prompt": PROMPT, "kv_transfer_params": prefill_flags()},
                                     **{"X-Request-Id": "r1"})
            return status, msgspec.json.decode(raw)["kv_transfer_params"]

    status, params = asyncio.run(scenario())
    assert status == 200
    section = pd_section_of(params)
    expected = mock_expert_signature({"prompt": PROMPT}, 2, 16).encode()
    assert section == PdSection(prompt_tokens=100, cached_tokens=0, engine_id="p0", mode="pull",
                                block_size=16, experts=expected)
    assert ExpertSignature.decode(section.experts).layers == 2
    assert params["remote_request_id"] == "r1" and params["remote_engine_id"] == "p0"


def test_decode_with_another_prompts_kv_answers_409_under_both_timings():
    async def scenario(*timing: str):
        async with mock("--role", "prefill", *timing) as (prefill, p_engine), \
                mock("--role", "decode", *timing) as (decode, d_engine), aiohttp.ClientSession() as http:
            out = []
            for prompt, key in ((PROMPT, "a"), (PROMPT, "b")):
                leg = {"prompt": prompt, "kv_transfer_params": prefill_flags()}
                status, raw = await post(http, prefill, leg, **{"X-Request-Id": key})
                assert status == 200
                params = msgspec.json.decode(raw)["kv_transfer_params"]
                out.append(await post(http, decode, {"prompt": OTHER if key == "a" else PROMPT,
                                                     "kv_transfer_params": params}))
            for _ in range(100):  # a modelled decode reads the transfer for good in the background
                if p_engine.side.rooms_held() == 0:
                    break
                await asyncio.sleep(0.01)
            return [s for s, _ in out], d_engine.stats.counts, p_engine.side.rooms_held()

    modelled = ("--latency-model", "llama-3.1-8b@h100", "--speedup", "50")
    for timing in ((), modelled):
        statuses, counts, held = asyncio.run(scenario(*timing))
        assert statuses == [409, 200], timing
        assert counts["remote_decodes"] == 2 and counts["mismatched_kv"] == 1, timing
        assert held == 0, timing  # both transfers read, the mismatched one too


def test_metrics_show_both_engines_load_gauges():
    async def scenario():
        async with mock("--tpot-ms", "50") as (url, _), aiohttp.ClientSession() as http:
            slow = asyncio.create_task(post(http, url, {"prompt": PROMPT, "max_tokens": 10}))
            await asyncio.sleep(0.2)
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            await slow
            return text

    text = asyncio.run(scenario())
    assert parse_engine_metrics(text, "vllm") == (0, 1, 0.0)
    assert parse_engine_metrics(text, "sglang") == (0, 1, 0.0)


def test_a_stream_breaks_after_the_injected_token_count_and_counts_usage_when_asked():
    async def scenario():
        async with mock("--break-stream-after", "2") as (url, engine), aiohttp.ClientSession() as http:
            body = {"prompt": PROMPT, "max_tokens": 5, "stream": True}
            async with http.post(url + "/v1/completions", json=body) as resp:
                broken = []
                with contextlib.suppress(aiohttp.ClientPayloadError):
                    async for line in resp.content:
                        broken.append(line)
            engine.faults.break_stream_after = 0
            async with http.post(url + "/v1/completions", json={
                    **body, "stream_options": {"include_usage": True}}) as resp:
                whole = [line async for line in resp.content]
            return broken, whole

    broken, whole = asyncio.run(scenario())
    events = lambda lines: [line for line in lines if line.startswith(b"data: ")]  # noqa: E731
    assert len(events(broken)) == 2 and b"[DONE]" not in b"".join(broken)
    got = events(whole)
    assert got[-1] == b"data: [DONE]\n"
    assert msgspec.json.decode(got[-2][6:])["usage"]["completion_tokens"] == 5
    assert len(got) == 5 + 2
