"""A fake vLLM/SGLang server for router tests and benchmarks (no model runs).

It answers the OpenAI endpoints with deterministic text (a function of the prompt only), with
configurable delays and injected failures, and it checks the PD handshake the way a real engine
depends on it: a prefill registers each request's prompt digest under its transfer key on a small
"side server" (side_channel.py); the decode fetches it from there before producing anything. KV
that belongs to another prompt is refused with HTTP 409, and a decode whose prefill never arrives
waits (up to --transfer-timeout-s) as a real one does. A prefill answers with the `pd` section a
PD connector adds (vocab/transfer_params.py), with a fake expert signature under --moe-experts.
With --kv-verdict / --kv-mismatch-match a remote decode reports on the KV it "loaded" as a
verifying connector does: `pd.kv` in a non-streamed answer, and vLLM's mismatch counter on /metrics.

This module is the HTTP side: parsing, fault injection (faults.py), the PD legs and streaming.
When tokens come is the timing's (timing.py): fixed delays, or with --latency-model MODEL@GPU the
engine model of pd_plugins.perf on an accelerated clock (--speedup), with engine metrics and
optional vLLM KV events to match (modelled.py). Counters: stats.py; the mock's own endpoints as
its clients read them: protocol.py and client.py.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import uuid
from dataclasses import dataclass

import msgspec
from aiohttp import web

from pd_plugins.mock import answers
from pd_plugins.mock.experts import mock_expert_signature
from pd_plugins.mock.faults import Faults
from pd_plugins.mock.modelled import ModelledTiming
from pd_plugins.mock.protocol import (
    BODIES_PATH, FAULTS_PATH, STATS_PATH, TIMINGS_PATH, LegTiming, prompt_digest,
)
from pd_plugins.mock.side_channel import KvHandoff, SideChannel
from pd_plugins.mock.stats import MockStats
from pd_plugins.mock.timing import FixedDelays, Kind, Run, Timing, Work
from pd_plugins.perf.hardware import preset
from pd_plugins.vocab.engines import ENGINES, TransferMode, load_metrics_text
from pd_plugins.vocab.transfer_params import KV_MISMATCHED_REQUESTS_METRIC, KvVerdict, PdSection

# What the mock's prefill answer stands for: vLLM's carries a pull's fields (remote block ids,
# host, port); an SGLang prefill sends its KV to the decode.
TRANSFER_MODE: dict[str, TransferMode] = {"vllm": "pull", "sglang": "push"}


@dataclass
class Leg:
    """One request as the mock serves it."""

    http: web.Request
    body: dict
    chat: bool
    digest: str           # protocol.prompt_digest
    prompt_tokens: int
    max_tokens: int
    arrived: float        # on the timing's clock
    kv: dict              # the request's kv_transfer_params
    key: str | None       # its transfer key (side_channel.py), None: not a PD leg
    run: Run | None = None
    handoff: KvHandoff | None = None


def make_timing(args: argparse.Namespace) -> Timing:
    if args.latency_model:
        return ModelledTiming(args)
    return FixedDelays(args.ttft_ms, args.prefill_ms_per_token, args.tpot_ms)


class MockEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.faults = Faults(args.fail_rate, args.garbage_rate, args.hang_rate, args.break_stream_after)
        self.rng = random.Random(args.seed)
        self.engine_id = args.engine_id or uuid.uuid4().hex
        self.stats = MockStats()
        self.side = SideChannel(args.engine, self.engine_id, args.side_port, args.transfer_timeout_s)
        self.timing = make_timing(args)
        self.kv_mismatched = 0  # remote decodes whose KV "mismatched" (--kv-mismatch-match)

    # -- OpenAI endpoints --------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        a, stats = self.args, self.stats
        if request.headers.get("X-Request-Id", "").startswith("pd-router-canary"):
            stats.count("canaries")  # health probes, kept apart from the traffic tests count
            injected = self._injected_fault()
            if injected is not None:
                return await injected
            return answers.json_answer(answers.completion(False, a.model, ["ok "], 1))
        stats.count("requests")
        arrived = self.timing.now()
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError:
            return answers.error(400, "invalid JSON")
        stats.bodies.append(body)
        if body.get("model") not in (None, a.model):
            return answers.error(404, f"The model `{body.get('model')}` does not exist.")
        max_tokens = answers.max_tokens(body)
        n_prompt = answers.prompt_tokens(body)
        if n_prompt + max_tokens > a.max_model_len:
            return answers.error(400, f"This model's maximum context length is {a.max_model_len} tokens.")
        injected = self._injected_fault()
        if injected is not None:
            return await injected

        kv = body.get("kv_transfer_params") or {}
        key = self.side.transfer_key(request.headers.get("X-Request-Id"), body, kv)
        leg = Leg(request, body, request.path.endswith("chat/completions"), prompt_digest(body), n_prompt,
                  max_tokens, arrived, kv, key)
        stats.running += 1
        try:
            if a.role == "prefill" or kv.get("do_remote_decode"):
                return await self._prefill(leg)
            return await self._decode(leg)
        except asyncio.CancelledError:  # the client closed the connection: aborted, as vLLM does
            stats.count("cancelled")
            if leg.handoff is not None:
                leg.handoff.abandon()
            if leg.run is not None:
                leg.run.abort()
            raise
        finally:
            stats.running -= 1

    async def _prefill(self, leg: Leg) -> web.Response:
        a = self.args
        self.stats.count("prefill_legs")
        leg.run = run = self.timing.start(Work("prefill", leg.prompt_tokens, 1, answers.token_ids(leg.body)),
                                          leg.arrived)
        await run.finished()
        if run.error is not None:
            return answers.error(400, run.error)
        self._timed(leg, "prefill", run)
        if leg.key is None:
            run.release()
        else:
            self.side.register(leg.key, leg.digest, run.release, self.timing.unread_kv_hold_s)
        params = self.side.transfer_params(leg.key)
        PdSection(prompt_tokens=leg.prompt_tokens, cached_tokens=run.cached_tokens, engine_id=self.engine_id,
                  mode=TRANSFER_MODE[a.engine], block_size=a.block_size,
                  experts=mock_expert_signature(leg.body, *a.moe_experts).encode() if a.moe_experts else None,
                  ).into(params)
        answer = answers.completion(leg.chat, a.model, answers.output_words(leg.digest, 1),
                                    leg.prompt_tokens, params)
        if a.prefill_params_null:
            answer["kv_transfer_params"] = None
        return answers.json_answer(answer)

    async def _decode(self, leg: Leg) -> web.StreamResponse:
        """A remote decode (its KV from a prefill), or a request served here from start to end."""
        kind: Kind = "local"
        arrived: float | None = leg.arrived
        if leg.key is not None:
            kind = "remote_decode"
            self.stats.count("remote_decodes")
            leg.handoff = self.side.handoff(leg.kv, leg.body, leg.key, leg.digest,
                                            self.timing.times_kv_transfer)
            if not await leg.handoff.before_start():
                return self._mismatched(leg)
            if leg.handoff.waited:  # its time in the engine starts now
                arrived = None
        else:
            self.stats.count("local")
        body = leg.body
        work = Work(kind, leg.prompt_tokens, leg.max_tokens, answers.token_ids(body), answers.output_ids(body))
        leg.run = run = self.timing.start(work, arrived)
        await run.first_token()
        if leg.handoff is not None:
            if not await leg.handoff.at_first_token():
                run.abort()
                return self._mismatched(leg)
            run.kv_accepted()
        if run.error is not None:
            return answers.error(400, run.error)
        self._timed(leg, kind, run)
        words = answers.output_words(leg.digest, leg.max_tokens)
        verdict = self._kv_verdict(leg) if kind == "remote_decode" else None
        if body.get("stream"):
            return await self._stream(leg, run, words)
        await run.finished()
        if run.error is not None:
            return answers.error(400, run.error)
        return answers.json_answer(answers.completion(leg.chat, self.args.model, words, leg.prompt_tokens,
                                                      verdict.into(None) if verdict else None))

    def _kv_verdict(self, leg: Leg) -> KvVerdict | None:
        """What a verifying connector would say about this decode's KV (and count)."""
        a = self.args
        match = a.kv_mismatch_match
        if (match and match in (leg.body.get("prompt") if isinstance(leg.body.get("prompt"), str)
                                else msgspec.json.encode(leg.body.get("messages", "")).decode())) \
                or (a.kv_mismatch_from and leg.kv.get("remote_engine_id") == a.kv_mismatch_from):
            self.kv_mismatched += 1
            word, mismatched = "recomputed", 1
        elif a.kv_verdict:
            word, mismatched = a.kv_verdict, 0
        else:
            return None
        blocks = -(-leg.prompt_tokens // a.block_size)
        return KvVerdict(verdict=word, blocks=blocks, mismatched=mismatched,
                         transport=TRANSFER_MODE[a.engine])

    def _mismatched(self, leg: Leg) -> web.Response:
        self.stats.count("mismatched_kv")
        return answers.error(409, f"KV under {leg.key} belongs to another prompt")

    def _timed(self, leg: Leg, kind: Kind, run: Run) -> None:
        if run.first_token_at is not None:
            self.stats.timings.append(LegTiming(leg.digest, kind, leg.arrived, run.first_token_at))

    async def _stream(self, leg: Leg, run: Run, words: list[str]) -> web.StreamResponse:
        chat, model = leg.chat, self.args.model
        out = web.StreamResponse(headers=answers.SSE_HEADERS)
        await out.prepare(leg.http)
        self.stats.streaming += 1
        sent, total = 0, len(words)
        brk = self.faults.break_stream_after if self.faults.break_stream_after < total else 0
        try:
            while True:
                upto = min(run.made, brk or total)
                if upto > sent:
                    await out.write(b"".join(answers.event(answers.chunk(
                        chat, model, words[i], "length" if i == total - 1 else None))
                        for i in range(sent, upto)))
                    sent = upto
                if brk and sent >= brk:
                    # an abrupt end, as when the engine dies: in the middle of its next event
                    cut = answers.event(answers.chunk(chat, model, words[sent], None))
                    await out.write(cut[:len(cut) // 2])
                    run.abort()
                    leg.http.transport.close()
                    return out
                if run.done:
                    break
                await run.progress()
            if sent < total:  # aborted or failed mid-way (cannot happen without an abort)
                await out.write(answers.event({"error": {"message": run.error or "aborted", "code": 500}}))
            elif (leg.body.get("stream_options") or {}).get("include_usage"):
                await out.write(answers.event({**answers.chunk(chat, model, "", None), "choices": [],
                                               "usage": answers.usage(leg.prompt_tokens, total)}))
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        except ConnectionResetError:  # the client left between two writes
            run.abort()
        finally:
            self.stats.streaming -= 1
        return out

    def _injected_fault(self):
        injected = self.faults.roll(self.rng)
        if injected is not None:
            self.stats.count("failed_injected")
        return injected

    # -- control and info --------------------------------------------------------------------
    async def set_faults(self, request: web.Request) -> web.Response:
        self.faults = self.faults.updated(await request.json())
        return web.json_response(self.faults.__dict__)

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats.snapshot(self.side.rooms_held(), self.timing.stats()))

    async def bodies(self, request: web.Request) -> web.Response:
        return web.json_response({"bodies": list(self.stats.bodies)})

    async def timings(self, request: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode({"timings": list(self.stats.timings)}),
                            content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.args.model, "object": "model", "max_model_len": self.args.max_model_len}]})

    async def metrics(self, request: web.Request) -> web.Response:
        # both engines' gauges: any router (vllm-router, sglang-router, pd-router) can scrape it
        load = self.timing.load(self.stats.running)
        text = "".join(load_metrics_text(engine, *load) for engine in ENGINES)
        if self.args.kv_verdict or self.args.kv_mismatch_match or self.args.kv_mismatch_from:
            text += f"{KV_MISMATCHED_REQUESTS_METRIC} {float(self.kv_mismatched)}\n"
        return web.Response(text=text)

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.args.model, "served_model_name": self.args.model,
                                  "disaggregation_mode": self.args.role, "dp_size": 1})

    def apps(self) -> tuple[web.Application, web.Application]:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([
            web.post("/v1/completions", self.generate), web.post("/v1/chat/completions", self.generate),
            web.get("/v1/models", self.models), web.get("/metrics", self.metrics),
            web.get("/health", self.ok), web.get("/health_generate", self.ok),
            web.get("/get_server_info", self.server_info), web.get("/server_info", self.server_info),
            web.get("/get_model_info", self.server_info), web.get("/model_info", self.server_info),
            web.post(FAULTS_PATH, self.set_faults), web.get(STATS_PATH, self.get_stats),
            web.get(BODIES_PATH, self.bodies),
        ])
        if self.timing.modelled:
            app.add_routes([web.get(TIMINGS_PATH, self.timings)])
        side = web.Application()
        side.add_routes([web.get("/room/{key}", self.side.room)])

        async def lifetime(_app):
            await self.side.open()
            await self.timing.open()
            yield
            await self.timing.close()
            await self.side.close()
        app.cleanup_ctx.append(lifetime)
        return app, side


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
    p.add_argument("--engine", choices=list(ENGINES), default="vllm")
    p.add_argument("--model", default="mock")
    p.add_argument("--engine-id", help="fixed kv engine id (vLLM push needs one)")
    p.add_argument("--prefill-params-null", action="store_true",
                   help="a prefill leg answers \"kv_transfer_params\": null (vLLM's push flow does "
                        "where its connector has none to give), the KV still pushed")
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
    p.add_argument("--kv-verdict", choices=["verified", "recomputed", "failed", "unverified"],
                   help="remote decodes answer this pd.kv verdict (non-streamed answers)")
    p.add_argument("--kv-mismatch-match", metavar="TEXT",
                   help="a remote decode whose prompt contains TEXT counts a KV mismatch "
                        f"({KV_MISMATCHED_REQUESTS_METRIC} on /metrics, streams too) and answers "
                        "pd.kv `recomputed`")
    p.add_argument("--kv-mismatch-from", metavar="ENGINE_ID",
                   help="the same for KV from the prefill with this engine id (a bad prefill)")
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
