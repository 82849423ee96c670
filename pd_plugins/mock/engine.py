"""A fake vLLM/SGLang server for router tests and benchmarks (no model runs).

It answers the OpenAI endpoints with deterministic text (a function of the prompt only), with
configurable delays and injected failures, and it checks the PD handshake the way a real engine
depends on it: a prefill registers each request's prompt digest under its transfer key on a small
"side server" (the NIXL side channel / SGLang bootstrap port); the decode fetches it from there
before producing anything. KV that belongs to another prompt is refused with HTTP 409, and a
decode whose prefill never arrives waits (up to --transfer-timeout-s) as a real one does.

Transfer keys: vLLM pull: remote_request_id from the prefill's kv_transfer_params; vLLM push: the
shared X-Request-Id; SGLang: bootstrap_room.

With --latency-model MODEL@GPU the fixed delays give way to the engine model of pd_plugins.perf
(continuous batching, prefix cache, bounded KV, KV transfer times) on an accelerated clock
(--speedup), with engine metrics and optional vLLM KV events to match: see modelled.py.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import numpy as np
from aiohttp import web

from pd_plugins.routers.policy.expert_signature import ExpertSignature

BODIES_KEPT = 64
WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "lambda", "sigma", "omega")
_encode = msgspec.json.Encoder().encode


@dataclass
class Faults:
    fail_rate: float = 0.0      # answer HTTP 500
    garbage_rate: float = 0.0   # answer 200 with a body that is not JSON
    hang_rate: float = 0.0      # never answer
    break_stream_after: int = 0  # close the connection after this many streamed tokens (0: never)


@dataclass
class MockState:
    args: argparse.Namespace
    faults: Faults
    rng: random.Random
    engine_id: str
    rooms: dict[str, asyncio.Future] = field(default_factory=dict)
    running: int = 0
    streaming: int = 0           # streams that have sent at least one token
    # the last request bodies received (GET /mock/bodies): what the router forwarded
    bodies: deque = field(default_factory=lambda: deque(maxlen=BODIES_KEPT))
    stats: dict[str, int] = field(default_factory=lambda: {
        "requests": 0, "prefill_legs": 0, "remote_decodes": 0, "local": 0, "mismatched_kv": 0,
        "failed_injected": 0, "canaries": 0, "cancelled": 0})


def prompt_digest(body: dict[str, Any]) -> str:
    source = body.get("prompt") if "prompt" in body else body.get("messages")
    return hashlib.blake2b(_encode(source), digest_size=8).hexdigest()


def mock_expert_counts(tokens: list[int], layers: int, experts: int) -> np.ndarray:
    """The mock's MoE routing (a fake, for ELDR tests and benchmarks): token t picks expert
    t mod experts in every layer. [layers, experts] counts."""
    counts = np.zeros((layers, experts))
    np.add.at(counts, (slice(None), np.asarray(tokens, dtype=np.int64) % experts), 1)
    return counts


def mock_expert_signature(body: dict[str, Any], layers: int, experts: int) -> ExpertSignature:
    """The prefill's answer under the mock routing; a text prompt's bytes stand in for tokens."""
    prompt = body.get("prompt")
    tokens = prompt if isinstance(prompt, list) else list(_encode(prompt or body.get("messages")))
    return ExpertSignature.from_counts(mock_expert_counts(tokens, layers, experts))


def mock_expert_pick(tokens: list[int], layers: int, experts: int, top_k: int) -> np.ndarray:
    """The decode's view of the same routing, for the engine model's expert-aware step time: the
    chance that one of the request's tokens picks each expert (top_k per token)."""
    counts = mock_expert_counts(tokens, layers, experts)
    return np.minimum(1.0, top_k * counts / max(1, len(tokens)))


def prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return max(1, len(prompt) // 4)
    return max(1, len(_encode(body.get("messages", ""))) // 4)


def output_words(digest: str, count: int) -> list[str]:
    seed = int(digest, 16)
    return [WORDS[(seed >> (i % 61)) % len(WORDS) ^ (i % 3)] + " " for i in range(count)]


class MockEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.s = MockState(args, Faults(args.fail_rate, args.garbage_rate, args.hang_rate,
                                        args.break_stream_after),
                           random.Random(args.seed), args.engine_id or uuid.uuid4().hex)
        self.session: aiohttp.ClientSession | None = None
        self.modelled = None
        if getattr(args, "latency_model", None):  # answers timed by the engine model (modelled.py)
            from pd_plugins.mock.modelled import ModelledServing
            self.modelled = ModelledServing(self)

    # -- OpenAI endpoints --------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        s, a = self.s, self.s.args
        if request.headers.get("X-Request-Id", "").startswith("pd-router-canary"):
            s.stats["canaries"] += 1  # health probes, kept apart from the traffic tests count
            injected = self._injected_fault()
            if injected is not None:
                return await injected
            return web.Response(body=_encode(_completion(False, a.model, ["ok "], 1)),
                                content_type="application/json")
        s.stats["requests"] += 1
        arrived = self.modelled.driver.now() if self.modelled is not None else 0.0
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError:
            return _error(400, "invalid JSON")
        s.bodies.append(body)
        chat = request.path.endswith("chat/completions")
        if body.get("model") not in (None, a.model):
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if prompt_tokens(body) + max_tokens > a.max_model_len:
            return _error(400, f"This model's maximum context length is {a.max_model_len} tokens.")
        injected = self._injected_fault()
        if injected is not None:
            return await injected

        kv = body.get("kv_transfer_params") or {}
        digest = prompt_digest(body)
        key = self._transfer_key(request, body, kv)
        is_prefill = a.role == "prefill" or kv.get("do_remote_decode") or (
            a.engine == "sglang" and a.role == "prefill")
        s.running += 1
        if self.modelled is not None:
            try:
                return await self.modelled.generate(request, body, chat, digest, key, kv, bool(is_prefill),
                                                    max_tokens, arrived)
            finally:
                s.running -= 1
        try:
            return await self._serve(request, body, chat, digest, key, kv, is_prefill, max_tokens)
        except asyncio.CancelledError:  # the client closed the connection: aborted, as vLLM does
            s.stats["cancelled"] += 1
            raise
        finally:
            s.running -= 1

    async def _serve(self, request, body, chat, digest, key, kv, is_prefill, max_tokens):
        s = self.s
        if is_prefill:
            return await self._prefill(request, body, chat, digest, key)
        if key is not None:
            s.stats["remote_decodes"] += 1
            held = await self.fetch_kv(kv, body, key)
            if held != digest:
                s.stats["mismatched_kv"] += 1
                return _error(409, f"KV under {key} belongs to another prompt")
            first_delay = 0.0
        else:
            s.stats["local"] += 1
            first_delay = self._prefill_s(body)
        return await self._answer(request, body, chat, digest, max_tokens, first_delay)

    def _transfer_key(self, request: web.Request, body: dict, kv: dict) -> str | None:
        if self.s.args.engine == "sglang":
            room = body.get("bootstrap_room")
            return None if room is None else str(room)
        if kv.get("do_remote_decode"):  # vLLM prefill leg: pull key, and push key
            return request.headers.get("X-Request-Id") or uuid.uuid4().hex
        if kv.get("do_remote_prefill"):
            return str(kv.get("remote_request_id"))
        return None

    def _prefill_s(self, body: dict) -> float:
        a = self.s.args
        return (a.ttft_ms + a.prefill_ms_per_token * prompt_tokens(body)) / 1e3

    async def _prefill(self, request, body, chat, digest, key) -> web.StreamResponse:
        s = self.s
        s.stats["prefill_legs"] += 1
        await asyncio.sleep(self._prefill_s(body))
        if key is not None:
            self.register_room(key, digest)
        params = self.transfer_params(key)
        if s.args.moe_experts:
            params["pd"] = {"experts": mock_expert_signature(body, *s.args.moe_experts).encode()}
        return web.Response(body=_encode(_completion(chat, s.args.model, output_words(digest, 1),
                                                     prompt_tokens(body), params)),
                            content_type="application/json")

    def register_room(self, key: str, digest: str) -> None:
        """The prefill's KV under `key` is ready for a decode to read."""
        rooms = self.s.rooms
        rooms.setdefault(key, asyncio.get_running_loop().create_future())
        if not rooms[key].done():
            rooms[key].set_result(digest)

    def transfer_params(self, key: str | None) -> dict[str, Any]:
        s = self.s
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": s.engine_id,
                "remote_request_id": key, "remote_block_ids": [list(range(3))],
                "remote_host": "127.0.0.1", "remote_port": s.args.side_port, "tp_size": 1}

    async def fetch_kv(self, kv: dict, body: dict, key: str, peek: bool = False) -> str | None:
        """The digest the prefill registered under `key` (waiting for it); reading it frees the
        transfer there, unless `peek`."""
        if self.s.args.engine == "sglang":
            host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        else:
            host, port = kv.get("remote_host"), kv.get("remote_port")
        url = f"http://{host}:{port}/room/{key}" + ("?peek=1" if peek else "")
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(
                    total=self.s.args.transfer_timeout_s)) as resp:
                return (await resp.text()) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def _answer(self, request, body, chat, digest, max_tokens, first_delay) -> web.StreamResponse:
        a = self.s.args
        words = output_words(digest, max_tokens)
        await asyncio.sleep(first_delay + a.tpot_ms / 1e3)
        if not body.get("stream"):
            await asyncio.sleep(a.tpot_ms / 1e3 * (max_tokens - 1))
            return web.Response(body=_encode(_completion(chat, a.model, words, prompt_tokens(body))),
                                content_type="application/json")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        self.s.streaming += 1
        try:
            return await self._stream_words(request, out, chat, words)
        finally:
            self.s.streaming -= 1

    async def _stream_words(self, request, out, chat, words) -> web.StreamResponse:
        a = self.s.args
        for i, word in enumerate(words):
            if i and a.tpot_ms:
                await asyncio.sleep(a.tpot_ms / 1e3)
            if self.s.faults.break_stream_after and i == self.s.faults.break_stream_after:
                request.transport.close()  # an abrupt end, as when the engine dies
                return out
            last = i == len(words) - 1
            await out.write(b"data: " + _encode(_chunk(chat, a.model, word, "length" if last else None))
                            + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    def _injected_fault(self):
        f, rng = self.s.faults, self.s.rng
        roll = rng.random()
        if roll < f.fail_rate:
            self.s.stats["failed_injected"] += 1
            return _later(_error(500, "injected failure"))
        roll -= f.fail_rate
        if roll < f.garbage_rate:
            self.s.stats["failed_injected"] += 1
            return _later(web.Response(body=b"<html>garbage", content_type="application/json"))
        roll -= f.garbage_rate
        if roll < f.hang_rate:
            self.s.stats["failed_injected"] += 1
            return _hang()
        return None

    # -- side server: where decodes fetch a prefill's KV --------------------------------------
    async def room(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        future = self.s.rooms.setdefault(key, asyncio.get_running_loop().create_future())
        try:
            digest = await asyncio.wait_for(asyncio.shield(future), self.s.args.transfer_timeout_s)
        except asyncio.TimeoutError:
            return web.Response(status=404, text="no such transfer")
        if request.query.get("peek"):  # a modelled decode checks early and reads at its first token
            return web.Response(text=digest)
        self.s.rooms.pop(key, None)  # read once, then freed
        if self.modelled is not None:
            self.modelled.room_read(key)  # the prefill's KV is free again
        return web.Response(text=digest)

    # -- control and info --------------------------------------------------------------------
    async def set_faults(self, request: web.Request) -> web.Response:
        self.s.faults = msgspec.convert({**self.s.faults.__dict__, **await request.json()}, Faults)
        return web.json_response(self.s.faults.__dict__)

    async def stats(self, request: web.Request) -> web.Response:
        modelled = self.modelled.driver.stats() if self.modelled is not None else {}
        return web.json_response({**self.s.stats, "rooms_held": sum(
            1 for f in self.s.rooms.values() if f.done()), "running": self.s.running,
            "streaming": self.s.streaming, **modelled})

    async def bodies(self, request: web.Request) -> web.Response:
        return web.json_response({"bodies": list(self.s.bodies)})

    async def timings(self, request: web.Request) -> web.Response:
        return web.json_response({"timings": list(self.modelled.timings)})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.s.args.model, "object": "model", "max_model_len": self.s.args.max_model_len}]})

    async def metrics(self, request: web.Request) -> web.Response:
        if self.modelled is not None:
            return web.Response(text=self.modelled.driver.metrics())
        return web.Response(text=(f"vllm:num_requests_waiting 0\nvllm:num_requests_running {self.s.running}\n"
                                  f"vllm:kv_cache_usage_perc 0\nsglang:num_queue_reqs 0\n"
                                  f"sglang:num_running_reqs {self.s.running}\nsglang:token_usage 0\n"))

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.s.args.model, "served_model_name": self.s.args.model,
                                  "disaggregation_mode": self.s.args.role, "dp_size": 1})

    def apps(self) -> tuple[web.Application, web.Application]:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([
            web.post("/v1/completions", self.generate), web.post("/v1/chat/completions", self.generate),
            web.get("/v1/models", self.models), web.get("/metrics", self.metrics),
            web.get("/health", self.ok), web.get("/health_generate", self.ok),
            web.get("/get_server_info", self.server_info), web.get("/server_info", self.server_info),
            web.get("/get_model_info", self.server_info), web.get("/model_info", self.server_info),
            web.post("/mock/faults", self.set_faults), web.get("/mock/stats", self.stats),
            web.get("/mock/bodies", self.bodies),
        ])
        side = web.Application()
        side.add_routes([web.get("/room/{key}", self.room)])

        async def open_session(_app):
            self.session = aiohttp.ClientSession()
            yield
            await self.session.close()
        app.cleanup_ctx.append(open_session)
        if self.modelled is not None:
            app.add_routes([web.get("/mock/timings", self.timings)])
            app.on_startup.append(self.modelled.start)
            app.on_cleanup.append(self.modelled.stop)
        return app, side


def _completion(chat: bool, model: str, words: list[str], n_prompt: int,
                kv_transfer_params: dict | None = None) -> dict:
    text = "".join(words)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
              if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
    out = {"id": f"mock-{uuid.uuid4().hex[:12]}", "object": "chat.completion" if chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": [choice],
           "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(words),
                     "total_tokens": n_prompt + len(words)}}
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def _chunk(chat: bool, model: str, word: str, finish: str | None) -> dict:
    choice = ({"index": 0, "delta": {"content": word}, "finish_reason": finish} if chat
              else {"index": 0, "text": word, "logprobs": None, "finish_reason": finish})
    return {"id": "mock", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=_encode({"error": {"message": message, "code": status}}),
                        content_type="application/json")


async def _later(response: web.Response) -> web.Response:
    return response


async def _hang() -> web.Response:
    await asyncio.sleep(3600)
    return _error(500, "hung")


def _layers_by_experts(text: str) -> tuple[int, int]:
    layers, _, experts = text.partition(",")
    if not (layers.isdigit() and experts.isdigit() and int(layers) > 0 and int(experts) > 0):
        raise argparse.ArgumentTypeError("expected LAYERS,EXPERTS, e.g. 4,16")
    return int(layers), int(experts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-mock-engine", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--side-port", type=int, required=True,
                   help="where decodes fetch KV: the NIXL side channel / SGLang bootstrap port")
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    p.add_argument("--model", default="mock")
    p.add_argument("--engine-id", help="fixed kv engine id (vLLM push needs one)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--ttft-ms", type=float, default=0.0, help="fixed prefill time")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    p.add_argument("--tpot-ms", type=float, default=0.0, help="time per output token")
    p.add_argument("--transfer-timeout-s", type=float, default=30.0)
    p.add_argument("--fail-rate", type=float, default=0.0)
    p.add_argument("--garbage-rate", type=float, default=0.0)
    p.add_argument("--hang-rate", type=float, default=0.0)
    p.add_argument("--break-stream-after", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--moe-experts", type=_layers_by_experts, metavar="LAYERS,EXPERTS",
                   help="prefill answers carry a fake expert signature (token t -> expert t mod "
                        "EXPERTS in every layer) in their pd section, for ELDR routing")
    m = p.add_argument_group("latency model", "time answers with the engine model (pd_plugins.perf) "
                                              "instead of the fixed delays above")
    m.add_argument("--latency-model", metavar="PRESET",
                   help="MODEL@GPU hardware preset, e.g. llama-3.1-8b@h100 (default: off)")
    m.add_argument("--speedup", type=float, default=1.0,
                   help="model seconds per wall second (an accelerated clock)")
    m.add_argument("--block-size", type=int, default=16, help="KV block size (match the router's)")
    m.add_argument("--kv-capacity-tokens", type=int,
                   help="KV cache size (default: what fits in GPU memory beside the weights)")
    m.add_argument("--max-batched-tokens", type=int, default=8192)
    m.add_argument("--max-running", type=int, default=256)
    m.add_argument("--kv-events", metavar="ENDPOINT",
                   help="publish vLLM KV events on a ZMQ PUB socket bound here, e.g. tcp://127.0.0.1:5557")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.latency_model:
        return
    from pd_plugins.perf.hardware import preset
    try:
        preset(args.latency_model)
    except ValueError as exc:
        p.error(str(exc))
    for name in ("speedup", "block_size", "max_batched_tokens", "max_running"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.kv_capacity_tokens is not None and args.kv_capacity_tokens < args.block_size:
        p.error("--kv-capacity-tokens must hold at least one block")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    engine = MockEngine(args)
    app, side = engine.apps()

    async def serve() -> None:
        runners = []
        for application, port in ((app, args.port), (side, args.side_port)):
            # A closed connection cancels its handler: the request is aborted, as vLLM does.
            runner = web.AppRunner(application, access_log=None, handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, args.host, port).start()
            runners.append(runner)
        print(f"pd-mock-engine ({args.engine} {args.role}) on http://{args.host}:{args.port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            for runner in runners:
                await runner.cleanup()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
