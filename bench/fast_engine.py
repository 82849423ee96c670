"""Mock PD engines at the least cost: the engine side of bench/router_overhead.py.

    .venv/bin/python -m bench.fast_engine --vllm PREFILL_PORT DECODE_PORT \
        --sglang PREFILL_PORT DECODE_PORT

Why: the router benchmark puts the engines and the load generator on one core and the router
alone on the other. pd-mock-engine (aiohttp, and an HTTP side-channel request per transfer)
saturated that core before any router saturated its own, so the routers' tail at saturation was
never measured (issue 30). These engines answer from plain asyncio.Protocol callbacks (uvloop,
httptools, msgspec, answers built once), all four in one process.

What each does, zero time everywhere: a vLLM prefill answers one token with the
kv_transfer_params a PdNixl prefill gives (NIXL's fields and the `pd` section; vllm-router and
pd-router pass them to the decode); a vLLM decode answers the whole completion, or streams it
(one write: every token's event, then `[DONE]`); an SGLang prefill answers one token, and an
SGLang decode answers once the prefill of its `bootstrap_room` has (as a real decode waits for
the KV), or at once without a room. GETs answer health, models, server info and the load gauges
both engines export. No validation, faults, KV or timing model: for routers' behaviour,
pd-mock-engine; this measures their cost.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import OrderedDict
from typing import Callable

import msgspec

from bench.floor_proxy import RequestReader
from pd_plugins.mock import answers as mock
from pd_plugins.vocab.engines import ENGINES, load_metrics_text
from pd_plugins.vocab.transfer_params import PdSection

MODEL = "mock"
PROMPT_TOKENS = 60  # what the answers' usage says (the benchmark's prompt is about that long)
BLOCK_SIZE = 16
ROOMS_KEPT = 4096  # rooms whose prefill answered, kept for a decode still to come (oldest out)
ROOM_WAIT_S = 30.0  # a decode whose prefill never comes answers 504 after this
ANSWERS_KEPT = 64  # answers built once, by (chat, stream, tokens); others are built each time
WORD = "alpha "
_encode, _decode = msgspec.json.Encoder().encode, msgspec.json.Decoder().decode


def whole(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 %b\r\nContent-Type: %b\r\nContent-Length: %d\r\n\r\n%b"
            % (status, content_type, len(body), body))


def completion(chat: bool, tokens: int, params: dict | None) -> bytes:
    return whole(b"200 OK", b"application/json", _encode(
        mock.completion(chat, MODEL, [WORD] * tokens, PROMPT_TOKENS, params)))


def stream(chat: bool, tokens: int) -> bytes:
    body = b"".join(mock.event(mock.chunk(chat, MODEL, WORD, "length" if i == tokens - 1 else None))
                    for i in range(tokens))
    done = b"data: [DONE]\n\n"
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n"
            % (len(body), body, len(done), done))


def kv_params(port: int) -> dict:
    """A PdNixl prefill's kv_transfer_params: where the decode reads the KV (NIXL's fields) and
    the `pd` section pd-router books (vocab/transfer_params.py)."""
    engine_id = f"fast-{port}"
    return PdSection(prompt_tokens=PROMPT_TOKENS, cached_tokens=0, engine_id=engine_id, mode="pull",
                     block_size=BLOCK_SIZE).into({
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
        "remote_request_id": "fast", "remote_block_ids": [[0, 1, 2, 3]],
        "remote_host": "127.0.0.1", "remote_port": port, "tp_size": 1})


class Answers:
    """Every answer one engine gives, built once: (chat, stream, tokens) -> bytes."""

    def __init__(self, params: dict | None) -> None:
        self.params, self.built = params, {}

    def __call__(self, chat: bool, streamed: bool, tokens: int) -> bytes:
        key = (chat, streamed, tokens)
        answer = self.built.get(key)
        if answer is None:
            answer = stream(chat, tokens) if streamed else completion(chat, tokens, self.params)
            if len(self.built) < ANSWERS_KEPT:
                self.built[key] = answer
        return answer


GETS = {
    b"/health": whole(b"200 OK", b"application/json", b'{"status":"ok"}'),
    b"/health_generate": whole(b"200 OK", b"application/json", b'{"status":"ok"}'),
    b"/v1/models": whole(b"200 OK", b"application/json", _encode({"object": "list", "data": [
        {"id": MODEL, "object": "model", "max_model_len": 32768}]})),
    b"/metrics": whole(b"200 OK", b"text/plain; version=0.0.4",
                       "".join(load_metrics_text(e, 0, 0, 0) for e in ENGINES).encode()),
}
NOT_FOUND = whole(b"404 Not Found", b"application/json", b'{"error":"not found"}')
TIMED_OUT = whole(b"504 Gateway Timeout", b"application/json", b'{"error":"no prefill"}')
ROOM_TAKEN = whole(b"409 Conflict", b"application/json", b'{"error":"a decode waits in this room"}')


class Rooms:
    """SGLang's hand-off in one process: a decode answers once its room's prefill has."""

    def __init__(self) -> None:
        self.ready: OrderedDict[object, None] = OrderedDict()
        self.waiting: dict[object, tuple[Callable[[bytes | None], None], asyncio.TimerHandle]] = {}

    def prefilled(self, room: object) -> None:
        if room in self.waiting:
            go, expiry = self.waiting.pop(room)
            expiry.cancel()
            go(None)
            return
        self.ready[room] = None
        if len(self.ready) > ROOMS_KEPT:
            self.ready.popitem(last=False)

    def when_prefilled(self, room: object, go: Callable[[bytes | None], None]) -> None:
        """go(None) once the room's prefill has answered (at once if it has), else go(an error
        answer)."""
        if room in self.ready:
            del self.ready[room]
            go(None)
        elif room in self.waiting:
            go(ROOM_TAKEN)
        else:
            expiry = asyncio.get_running_loop().call_later(ROOM_WAIT_S, self._expire, room)
            self.waiting[room] = (go, expiry)

    def _expire(self, room: object) -> None:
        go, _ = self.waiting.pop(room)
        go(TIMED_OUT)


class Engine(RequestReader):
    def __init__(self, role: str, answers: Answers, rooms: Rooms | None, info: bytes) -> None:
        super().__init__()
        self.role, self.answers, self.rooms, self.info = role, answers, rooms, info

    def on_get(self, url: bytes) -> bytes:
        path = url.split(b"?", 1)[0]
        if path in GETS:
            return GETS[path]
        return self.info if b"info" in path else NOT_FOUND

    def serve(self, url: bytes, raw: bytes) -> None:
        body = _decode(raw)
        chat = url.endswith(b"chat/completions")
        if self.role == "prefill":
            self.transport.write(self.answers(chat, False, 1))
            room = body.get("bootstrap_room")
            if self.rooms is not None and room is not None:
                self.rooms.prefilled(room)
            return
        tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        answer = self.answers(chat, bool(body.get("stream")), tokens)
        room = body.get("bootstrap_room")
        if self.rooms is None or room is None:
            self.transport.write(answer)
            return
        transport = self.transport

        def go(refused: bytes | None) -> None:
            if not transport.is_closing():
                transport.write(refused or answer)

        self.rooms.when_prefilled(room, go)


def server_info(engine: str, role: str) -> bytes:
    return whole(b"200 OK", b"application/json", _encode({
        "model_path": MODEL, "served_model_name": MODEL, "disaggregation_mode": role,
        "dp_size": 1, "engine": engine}))


async def serve(ports: dict[tuple[str, str], int]) -> None:
    loop = asyncio.get_running_loop()
    rooms = Rooms()
    servers = []
    for (engine, role), port in ports.items():
        params = kv_params(port) if engine == "vllm" and role == "prefill" else None
        answers, info = Answers(params), server_info(engine, role)
        shared = rooms if engine == "sglang" else None

        def protocol(role=role, answers=answers, shared=shared, info=info) -> Engine:
            return Engine(role, answers, shared, info)

        servers.append(await loop.create_server(protocol, "127.0.0.1", port))
    print(f"fast engines on {', '.join(f'{e} {r} :{p}' for (e, r), p in ports.items())}",
          flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for engine in ENGINES:
        ap.add_argument(f"--{engine}", nargs=2, type=int, metavar=("PREFILL_PORT", "DECODE_PORT"))
    args = ap.parse_args(argv)
    ports = {(engine, role): port for engine in ENGINES if getattr(args, engine)
             for role, port in zip(("prefill", "decode"), getattr(args, engine))}
    if not ports:
        ap.error("no engine: --vllm and/or --sglang")
    import uvloop
    uvloop.run(serve(ports))


if __name__ == "__main__":
    main()
