"""The least a Python PD proxy can cost: a reference row for bench/router_overhead.py.

    .venv/bin/python -m bench.floor_proxy PREFILL_URL DECODE_URL PORT

vLLM's pull flow with nothing but the flow: prefill with max_tokens 1 and do_remote_decode, then
decode with the prefill's kv_transfer_params, and relay the answer (streamed or not). It is
written as the cheapest thing Python can run per request: uvloop, httptools on both sides, plain
asyncio.Protocol callbacks from the client's bytes to the answer's last byte (no coroutine, task or
future per request), msgspec for the two JSON bodies, keep-alive connections reused from a free
list. No policy, metrics, timeouts, limits, validation, failover or error handling beyond closing
the client's connection: it is not a router, it measures the floor under one on this machine, so
that pd-router's cost above it and the Rust routers' below it can be told apart (issue 30).
"""

from __future__ import annotations

import asyncio
from typing import Callable
from urllib.parse import urlsplit

import httptools
import msgspec

from bench.common import reference_proxy_args
from pd_plugins.vocab.transfer_params import prefill_flags

_encode, _decode = msgspec.json.Encoder().encode, msgspec.json.Decoder().decode
PREFILL_FLAGS = prefill_flags()
OK_JSON = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
OK_STREAM = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
             b"Transfer-Encoding: chunked\r\n\r\n")
HEALTH = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Upstream(asyncio.Protocol):
    """One keep-alive connection to an engine; one request at a time, answered by callbacks."""

    def __init__(self, pool: Pool) -> None:
        self.pool, self.transport, self.parser = pool, None, httptools.HttpResponseParser(self)
        self.sink: Callable[[bytes], None] | None = None  # where this request's body goes
        self.on_done: Callable[[], None] | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.sink(body)

    def on_message_complete(self) -> None:
        done = self.on_done
        self.on_done = None
        self.pool.free.append(self)
        done()

    def connection_lost(self, exc) -> None:
        if self in self.pool.free:
            self.pool.free.remove(self)


class Pool:
    connection = Upstream  # what a new connection to the engine is

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.head = (b"POST %s HTTP/1.1\r\nHost: " + f"{self.host}:{self.port}".encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n")
        self.free: list[Upstream] = []

    def send(self, path: bytes, body: bytes, on_body: Callable[[bytes], None],
             on_done: Callable[[], None]) -> None:
        def go(conn: Upstream) -> None:
            conn.sink, conn.on_done = on_body, on_done
            conn.transport.write(self.head % (path, len(body)) + body)

        self.acquire(go)

    def acquire(self, go: Callable[[Upstream], None]) -> None:
        """go(a free keep-alive connection), or go(a new one) once it is open."""
        if self.free:
            go(self.free.pop())
            return
        loop = asyncio.get_running_loop()
        made = loop.create_task(loop.create_connection(lambda: self.connection(self), self.host,
                                                       self.port))
        made.add_done_callback(lambda t: go(t.result()[1]))


class RequestReader(asyncio.Protocol):
    """A client connection's requests, read with httptools; each whole POST goes to serve()."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.url, self.body = b"", []

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, raw = self.url, b"".join(self.body)
        self.url, self.body = b"", []
        if self.parser.get_method() != b"POST":
            self.transport.write(self.on_get(url))
            return
        self.serve(url, raw)

    def on_get(self, url: bytes) -> bytes:
        """The whole answer to a GET: health."""
        return HEALTH

    def serve(self, url: bytes, raw: bytes) -> None:
        raise NotImplementedError


class Front(RequestReader):
    def __init__(self, prefill: Pool, decode: Pool) -> None:
        super().__init__()
        self.prefill, self.decode = prefill, decode

    def serve(self, url: bytes, raw: bytes) -> None:
        request = _decode(raw)
        stream = bool(request.get("stream"))
        leg = dict(request, max_tokens=1, stream=False, kv_transfer_params=PREFILL_FLAGS)
        answer: list[bytes] = []
        transport = self.transport

        def write(data: bytes) -> None:  # the client may have left (wrk closes mid-stream)
            if not transport.is_closing():
                transport.write(data)

        def decode_leg() -> None:
            leg2 = dict(request, kv_transfer_params=_decode(b"".join(answer))["kv_transfer_params"])
            if stream:
                write(OK_STREAM)
                self.decode.send(url, _encode(leg2),
                                 lambda chunk: write(b"%x\r\n%b\r\n" % (len(chunk), chunk)),
                                 lambda: write(b"0\r\n\r\n"))
            else:
                out: list[bytes] = []

                def relay() -> None:
                    body = b"".join(out)
                    write(OK_JSON % len(body) + body)

                self.decode.send(url, _encode(leg2), out.append, relay)

        self.prefill.send(url, _encode(leg), answer.append, decode_leg)


def main() -> None:
    prefill_url, decode_url, port = reference_proxy_args(__doc__)
    import uvloop

    async def serve() -> None:
        prefill, decode = Pool(prefill_url), Pool(decode_url)
        server = await asyncio.get_running_loop().create_server(
            lambda: Front(prefill, decode), "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
