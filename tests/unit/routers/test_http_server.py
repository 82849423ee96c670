"""The router's front HTTP server (inference requests on httptools, the rest handed to aiohttp),
on a real loopback socket, driven by aiohttp's client and by raw bytes where framing matters."""

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web

from pd_plugins.routers import http_server
from pd_plugins.routers.http_server import (MAX_HEADERS, FastRequest, FrontServer, RequestHeaders,
                                            body_too_slow, header_map, read_body, stream_response)

BODY = json.dumps({"prompt": "hi"}).encode()


class App:
    """The inference handler and the aiohttp fallback, recording what each served."""

    def __init__(self) -> None:
        self.fast: list[FastRequest] = []
        self.fallback: list[str] = []
        self.cancelled = asyncio.Event()
        self.written = 0
        self.blocked = asyncio.Event()

    async def handle(self, request: FastRequest):
        self.fast.append(request)
        mode = request.headers.get("X-Mode", "")
        if mode == "hang":  # until the client leaves
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        body = await request.read()
        if mode == "stream":
            out = stream_response(request, {"Content-Type": "text/event-stream"})
            for i in range(3):
                await out.write(b"data: %d\n\n" % i)
            await out.write_eof()
            return out
        if mode == "flood":  # a big answer to a client that does not read
            out = stream_response(request, {})
            try:
                while True:
                    await asyncio.wait_for(out.write(b"x" * 65536), 0.5)
                    self.written += 65536
            except TimeoutError:
                self.blocked.set()
                request.transport.abort()
                return out
        return web.json_response({"path": request.path, "query": request.query_string,
                                  "len": len(body)}, headers={"X-Served": "fast"})

    async def other(self, request: web.BaseRequest) -> web.Response:
        self.fallback.append(f"{request.method} {request.path}")
        try:  # as the router's aiohttp handlers read a body
            await read_body(request)
        except TimeoutError:
            return body_too_slow()
        return web.json_response({"path": request.path}, headers={"X-Served": "aiohttp"})


@contextlib.asynccontextmanager
async def front(app: App, front_of: list | None = None, **kwargs):
    """The front server on loopback (its port); `front_of`: a list given the server."""
    fallback = web.Server(app.other)
    server = FrontServer(app.handle, fallback, max_body=kwargs.pop("max_body", 1 << 20), **kwargs)
    if front_of is not None:
        front_of.append(server)
    listener = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
    try:
        yield listener.sockets[0].getsockname()[1]
    finally:
        listener.close()
        await server.shutdown(1.0)
        await fallback.shutdown(1.0)


def run(scenario, **kwargs):
    async def main():
        app = App()
        async with front(app, **kwargs) as port:
            await scenario(app, port)
    asyncio.run(main())


async def exchange(port: int, raw: bytes, wait_s: float = 0.5) -> bytes:
    """Send raw bytes; everything the server sends back until it closes or `wait_s` passes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    got = b""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(wait_s):
            while chunk := await reader.read(65536):
                got += chunk
    writer.close()
    return got


def post(path: str = "/v1/completions", body: bytes = BODY, extra: bytes = b"") -> bytes:
    return (b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%b\r\n%b"
            % (path.encode(), len(body), extra, body))


def test_inference_requests_are_served_here_and_the_rest_by_aiohttp_on_one_connection():
    async def scenario(app, port):
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            for path in ("/v1/completions", "/v1/chat/completions?x=1"):
                async with s.post(path, data=BODY) as r:
                    assert r.status == 200 and r.headers["X-Served"] == "fast"
                    assert (await r.json())["len"] == len(BODY)
            async with s.get("/v1/models") as r:  # same keep-alive connection: handed over
                assert r.headers["X-Served"] == "aiohttp"
            async with s.post("/v1/completions", data=BODY) as r:  # aiohttp's from now on
                assert r.status == 200 and r.headers["X-Served"] == "aiohttp"
            async with s.post("/v1/completions/", data=BODY) as r:  # not an inference path
                assert r.headers["X-Served"] == "aiohttp"
        assert [r.path for r in app.fast] == ["/v1/completions", "/v1/chat/completions"]
        assert app.fast[1].query_string == "x=1"
        assert app.fallback == ["GET /v1/models", "POST /v1/completions", "POST /v1/completions/"]
    run(scenario)


def test_a_request_line_split_across_reads_is_still_decided_right():
    async def scenario(app, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        raw = post()
        for piece in (raw[:3], raw[3:12], raw[12:]):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"X-Served: fast" in head
        writer.close()
    run(scenario)


def test_streamed_answers_are_chunked_and_http10_ones_end_with_the_connection():
    async def scenario(app, port):
        got = await exchange(port, post(extra=b"X-Mode: stream\r\n"))
        assert b"Transfer-Encoding: chunked" in got and got.endswith(b"0\r\n\r\n")
        assert got.count(b"data: ") == 3
        got = await exchange(port, post(extra=b"X-Mode: stream\r\n").replace(b"HTTP/1.1", b"HTTP/1.0"))
        assert b"Transfer-Encoding" not in got and b"Connection: close" in got
        assert got.endswith(b"data: 2\n\n")
    run(scenario)


def test_pipelined_inference_requests_are_answered_in_order_and_others_refused():
    async def scenario(app, port):
        got = await exchange(port, post("/v1/completions?n=1") + post("/v1/completions?n=2"))
        assert got.count(b"HTTP/1.1 200") == 2
        assert [r.query_string for r in app.fast] == ["n=1", "n=2"]
        got = await exchange(port, post() + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert got.count(b"HTTP/1.1 200") == 1 and b"HTTP/1.1 400" in got
        assert b"pipelined" in got and app.fallback == []
    run(scenario)


def test_a_body_past_the_limit_is_refused_unread_and_the_connection_closed():
    async def scenario(app, port):
        # announced: answered before the body is sent (the client waits for 100-continue)
        got = await exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                   b"Content-Length: 5000\r\nExpect: 100-continue\r\n\r\n")
        assert b"100 Continue" not in got and b"Connection: close" in got
        assert app.fast and app.fast[-1]._too_large == 5000
        with pytest.raises(web.HTTPRequestEntityTooLarge):
            await app.fast[-1].read()
        # chunked: refused as soon as the pieces pass the limit
        chunk = b"800\r\n" + b"y" * 0x800 + b"\r\n"
        got = await exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                   b"Transfer-Encoding: chunked\r\n\r\n" + chunk * 3)
        assert app.fast[-1]._too_large > 4096
    run(scenario, max_body=4096)


def test_expect_continue_is_answered_for_a_body_within_the_limit():
    async def scenario(app, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                     b"Expect: 100-continue\r\n\r\n" % len(BODY))
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 Continue")
        writer.write(BODY)
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        writer.close()
    run(scenario)


def test_oversized_request_lines_and_headers_and_malformed_requests_get_4xx():
    async def scenario(app, port):
        got = await exchange(port, post("/v1/completions?" + "q" * 9000))
        assert got.startswith(b"HTTP/1.1 414")
        headers = b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
        assert (await exchange(port, post(extra=headers))).startswith(b"HTTP/1.1 431")
        got = await exchange(port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 400")
        assert app.fast == []
    run(scenario)


async def send_endless(port: int, start: bytes, filler: bytes, limit_s: float = 3.0) -> bytes:
    """Send `start`, then `filler` in 64 KiB pieces (a request line or header that never ends)
    until the server answers or closes, at most 16 MiB; what it answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(start)
    piece = filler * (65536 // len(filler))
    got = b""
    with contextlib.suppress(ConnectionError, TimeoutError):
        async with asyncio.timeout(limit_s):
            for _ in range(256):
                writer.write(piece)
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.001):
                        got += await reader.read(65536)
                if got:
                    break
            got += await reader.read(65536)
    writer.close()
    return got


def test_a_request_line_or_header_that_never_ends_is_refused_as_it_crosses_its_limit():
    # the read timeout (60 s) is far away: only a refusal on the way can answer within 3 s, and
    # the server buffers no more than the limit of what it is sent (16 MiB at most here)
    async def scenario(app, port):
        got = await send_endless(port, b"POST /v1/completions?", b"q")
        assert got.startswith(b"HTTP/1.1 414"), got[:80]
        got = await send_endless(port, b"POST /v1/completions HTTP/1.1\r\nX-Long: ", b"v")
        assert got.startswith(b"HTTP/1.1 431"), got[:80]
        # many headers, each within limits, that never end their head
        got = await send_endless(port, b"POST /v1/completions HTTP/1.1\r\n", b"X-Many: v\r\n")
        assert got.startswith(b"HTTP/1.1 431"), got[:80]
        assert app.fast == []
        # a head within its limits that arrives in many pieces is served
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for piece in (b"POST /v1/completions HTTP/1.1\r\n", b"X-A: " + b"a" * 60000 + b"\r\n",
                      post()[len(b"POST /v1/completions HTTP/1.1\r\n"):]):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)
        async with asyncio.timeout(2):
            assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
        writer.close()
    run(scenario)


def test_header_bounds_hold_for_distinct_repeated_and_large_headers():
    # the front server reads a head's fields in C (no Python per header): its bounds are
    # checked per read and at the head's end instead (a repeated name counts once: only its
    # first value is kept, the rest bounded with the head's bytes)
    async def scenario(app, port):
        # distinct headers past MAX_HEADERS, the head never ended: refused at once (far under
        # MAX_HEAD_BYTES, and the read timeout is a minute away)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\n")
        for i in range(0, MAX_HEADERS + 10, 10):
            writer.write(b"".join(b"X-H%d: v\r\n" % j for j in range(i, i + 10)))
            await writer.drain()
            await asyncio.sleep(0.01)
        async with asyncio.timeout(2):
            assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 431")
        writer.close()
        # a whole head whose headers hold more than MAX_HEADER_BYTES (within MAX_HEAD_BYTES)
        big = b"X-A: %b\r\nX-B: %b\r\n" % (b"a" * 33000, b"b" * 33000)
        assert (await exchange(port, post(extra=big))).startswith(b"HTTP/1.1 431")
        assert app.fast == []
        # a repeated header: the first value is the request's (as aiohttp's CIMultiDict.get)
        got = await exchange(port, post(extra=b"X-Request-Id: first\r\nx-request-id: 2nd\r\n"
                                              b"X-Request-Id: third\r\n"))
        assert got.startswith(b"HTTP/1.1 200")
        assert app.fast[-1].headers.get("X-Request-Id") == "first"
    run(scenario)


def test_header_names_past_the_count_are_dropped_at_each_reads_end_whatever_the_state():
    # httptools hands every header and trailer to a dict in C: a read may add thousands; what
    # is past MAX_HEADERS goes at the read's end, also for trailers that end their request in
    # that read and for a head pipelined behind a request being answered
    servers: list[FrontServer] = []
    many = b"".join(b"X-%d: v\r\n" % i for i in range(5000))

    async def scenario(app, port):
        chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n")
        got = await exchange(port, chunked + b"2\r\n{}\r\n0\r\n" + many + b"\r\n")
        assert got.startswith(b"HTTP/1.1 431"), got[:80]
        assert app.fast == []
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post() + b"POST /v1/completions HTTP/1.1\r\n" + many)
        async with asyncio.timeout(2):
            assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
        [server] = servers
        assert len(app.fast) == 1 and server.connections
        assert all(len(conn.fields) <= MAX_HEADERS for conn in server.connections)
        writer.write(b"\r\n")  # the pipelined head ends: refused, and the connection closed
        async with asyncio.timeout(2):
            rest = await reader.read()
        assert b"HTTP/1.1 431" in rest and len(app.fast) == 1
        writer.close()
    run(scenario, front_of=servers)


def test_a_request_begun_behind_an_answered_one_has_its_read_timeout():
    async def scenario(app, port):
        # one read: a whole request, then the start of one whose body never completes
        got = await exchange(port, post() + post()[:-5], wait_s=2.5)
        assert got.startswith(b"HTTP/1.1 200")
        assert b"HTTP/1.1 408" in got, got[-200:]
    run(scenario, read_timeout_s=0.5, keepalive_timeout_s=30)


def test_a_body_that_never_completes_on_the_aiohttp_side_gets_a_408(monkeypatch):
    # aiohttp times out only idle connections: read_body bounds its handlers' reads
    monkeypatch.setattr(http_server, "READ_TIMEOUT_S", 0.5)

    async def scenario(app, port):
        got = await exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"  # to aiohttp
                             + post()[:-5], wait_s=3)  # then a body that never completes
        assert got.startswith(b"HTTP/1.1 200")
        assert b"HTTP/1.1 408" in got and b"not received within 0.5 s" in got, got[-300:]
        assert app.fallback == ["GET /health", "POST /v1/completions"] and app.fast == []
    run(scenario, read_timeout_s=30, keepalive_timeout_s=30)


def test_the_routers_own_generate_answers_408_for_a_body_that_never_completes(monkeypatch):
    """The same bound through the router's real handler (Router.generate on its aiohttp app, as
    after a handoff), counted as a read_timeout rejection; workers that answer nothing."""
    from pd_plugins.routers.cli import build_parser, config_from_args
    from pd_plugins.routers.server import Router

    monkeypatch.setattr(http_server, "READ_TIMEOUT_S", 0.5)
    router = Router(config_from_args(build_parser().parse_args(
        ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"])))

    async def main():
        runner = web.AppRunner(router.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            port = site._server.sockets[0].getsockname()[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post()[:-5])
            got = b""
            async with asyncio.timeout(5):
                while b"\r\n\r\n" not in got or not got.endswith(b"}"):
                    got += await reader.read(65536) or b"}"
            writer.close()  # aiohttp lingers up to 10 s for the rest of a body otherwise
            await writer.wait_closed()
            await asyncio.sleep(0.1)  # the server sees the close before its shutdown
        finally:
            await runner.cleanup()
        return got

    got = asyncio.run(main())
    assert got.startswith(b"HTTP/1.1 408") and b"not received within 0.5 s" in got, got[-300:]
    assert router.metrics.rejections.labels("read_timeout")._value.get() == 1


def test_a_client_that_leaves_cancels_its_handler():
    async def scenario(app, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(extra=b"X-Mode: hang\r\n"))
        await asyncio.sleep(0.2)
        writer.close()
        async with asyncio.timeout(2):
            await app.cancelled.wait()
    run(scenario)


def test_a_client_that_does_not_read_holds_back_its_own_answer():
    async def scenario(app, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1024)
        writer.write(post(extra=b"X-Mode: flood\r\n"))
        async with asyncio.timeout(10):
            await app.blocked.wait()  # the writes waited on the socket instead of buffering
        assert app.written < 64 << 20
        writer.close()
    run(scenario)


def test_a_request_begun_and_not_finished_times_out_and_idle_connections_close():
    async def scenario(app, port):
        got = await exchange(port, post()[:-5], wait_s=1.5)  # the body never completes
        assert got.startswith(b"HTTP/1.1 408")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        async with asyncio.timeout(2):
            assert await reader.read() == b""  # idle: closed by the server
    run(scenario, read_timeout_s=0.5, keepalive_timeout_s=0.5)


def test_the_authorize_hook_refuses_before_the_handler():
    def authorize(path, given):
        return None if given == "Bearer k" else web.Response(status=401, text="no")

    async def scenario(app, port):
        assert (await exchange(port, post())).startswith(b"HTTP/1.1 401")
        got = await exchange(port, post(extra=b"Authorization: Bearer k\r\n"))
        assert got.startswith(b"HTTP/1.1 200") and len(app.fast) == 1
    run(scenario, authorize=authorize)


def test_shutdown_lets_a_request_in_progress_finish():
    async def main():
        app = App()
        fallback = web.Server(app.other)
        server = FrontServer(app.handle, fallback, max_body=1 << 20)
        listener = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        slow = asyncio.Event()

        async def handle(request):
            await asyncio.sleep(0.3)
            slow.set()
            return web.Response(text="done")
        server.handler = handle
        pending = asyncio.create_task(exchange(port, post(), wait_s=2))
        await asyncio.sleep(0.1)
        listener.close()
        await server.shutdown(2.0)
        got = await pending
        assert slow.is_set() and got.startswith(b"HTTP/1.1 200") and got.endswith(b"done")
        assert b"Connection: close" in got
    asyncio.run(main())


def test_request_headers_are_looked_up_as_aiohttp_would():
    headers = RequestHeaders(header_map({b"X-Request-Id": b"first",
                                         b"content-type": b"application/json",
                                         b"x-request-id": b"second", b"X-Odd": b"caf\xc3\xa9\xff"}))
    assert headers.get("x-request-id") == headers.get("X-REQUEST-ID") == "first"  # the first wins
    assert headers.get("Content-Type") == "application/json"
    assert headers.get("X-Odd") == b"caf\xc3\xa9\xff".decode("utf-8", "surrogateescape")
    assert headers.get("Authorization", "") == "" and headers.get("Authorization") is None
    assert "CONTENT-type" in headers and "Authorization" not in headers
    assert headers["x-odd"].startswith("café")
    assert headers.has_any(frozenset((b"x-odd", b"x-none"))) and not headers.has_any(frozenset((b"x-none",)))
    with pytest.raises(KeyError):
        headers["Authorization"]


def test_chunk_framing_and_trailers_past_their_bounds_are_refused_as_they_arrive():
    # trailers come after the head: the head's 431 never counted them, and httptools built an
    # endless trailer's value in memory (32 MiB took the loop 4 s)
    chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def scenario(app, port):
        got = await send_endless(port, chunked + b"2\r\n{}\r\n0\r\nX-Trailer: ", b"v")
        assert got.startswith(b"HTTP/1.1 400") and b"trailers" in got, got[:200]
        got = await send_endless(port, chunked + b"2;", b"e")  # a chunk extension without end
        assert got.startswith(b"HTTP/1.1 400") and b"framing" in got, got[:200]
        got = await send_endless(port, chunked, b"1\r\na\r\n")  # one byte a chunk, no end
        assert got.startswith(b"HTTP/1.1 400") and b"chunks averaging" in got, got[:200]
        assert app.fast == []
        # a chunked body in pieces, with a small trailer, is served
        got = await exchange(port, chunked + b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in
                                                      (BODY[:5], BODY[5:])) + b"0\r\nX-T: 1\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200") and (json.loads(got.split(b"\r\n\r\n", 1)[1])["len"]
                                                    == len(BODY))
    run(scenario)


def test_a_protocol_upgrade_gets_a_400_not_a_logged_crash(caplog):
    async def scenario(app, port):
        for extra in (b"Connection: Upgrade\r\nUpgrade: h2c\r\n", b"Connection: upgrade\r\n"
                                                                 b"Upgrade: websocket\r\n"):
            got = await exchange(port, post(extra=extra))
            assert got.startswith(b"HTTP/1.1 400") and b"upgrade" in got, got[:200]
        await asyncio.sleep(0.05)
    caplog.set_level("ERROR")
    run(scenario)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_an_unauthorized_request_is_refused_at_its_headers_and_its_body_never_read():
    def authorize(path, given):
        return None if given == "Bearer k" else web.Response(status=401, text="no")

    async def scenario(app, port):
        # the head alone: answered without waiting for the megabyte it announces, and never
        # asked for it (no 100 Continue)
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n"
                b"Expect: 100-continue\r\n%b\r\n")
        got = await exchange(port, head % b"", wait_s=2)
        assert got.startswith(b"HTTP/1.1 401") and b"Connection: close" in got, got[:200]
        assert b"100 Continue" not in got
        got = await exchange(port, head % b"Authorization: Bearer wrong\r\n", wait_s=2)
        assert got.startswith(b"HTTP/1.1 401")
        got = await exchange(port, post(extra=b"Authorization: Bearer k\r\n"))
        assert got.startswith(b"HTTP/1.1 200") and len(app.fast) == 1
    run(scenario, authorize=authorize, read_timeout_s=30)


def test_connections_past_the_cap_are_answered_503_and_closed_at_once():
    async def scenario(app, port):
        first = await asyncio.open_connection("127.0.0.1", port)
        first[1].write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # handed to aiohttp: counted
        assert (await first[0].readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        second = await asyncio.open_connection("127.0.0.1", port)  # idle: counted
        await asyncio.sleep(0.05)
        got = await exchange(port, post(), wait_s=2)
        assert got.startswith(b"HTTP/1.1 503") and b"too many connections" in got, got[:200]
        assert app.fast == []
        second[1].close()
        await asyncio.sleep(0.1)
        assert (await exchange(port, post())).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.1)  # that exchange's connection closed on the server's side too
        third = await asyncio.open_connection("127.0.0.1", port)  # full again
        await asyncio.sleep(0.05)
        assert (await exchange(port, post(), wait_s=2)).startswith(b"HTTP/1.1 503")
        first[1].close()  # the handed-over one: no longer counted once aiohttp's side closes
        await asyncio.sleep(0.1)
        assert (await exchange(port, post())).startswith(b"HTTP/1.1 200")
        third[1].close()
    run(scenario, max_connections=2)


def test_the_router_closes_connections_handed_to_aiohttp_after_its_keepalive(monkeypatch):
    """Router.serve, in this process: an idle connection on aiohttp's side (after a GET) is
    closed after the front server's keep-alive timeout, not aiohttp's default hour."""
    import gc
    import os
    import signal
    import socket

    from pd_plugins.routers.cli import build_parser, config_from_args
    from pd_plugins.routers.server import Router

    monkeypatch.setattr(http_server, "KEEPALIVE_TIMEOUT_S", 0.5)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    router = Router(config_from_args(build_parser().parse_args(
        ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9",
         "--port", str(port)])))

    async def main():
        serving = asyncio.create_task(router.serve(shutdown_timeout_s=1))
        try:
            async with asyncio.timeout(10):
                while True:
                    try:
                        reader, writer = await asyncio.open_connection("127.0.0.1", port)
                        break
                    except OSError:
                        await asyncio.sleep(0.05)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(5):
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
                await reader.readuntil(b"}")
                started = asyncio.get_running_loop().time()
                assert await reader.read() == b""  # closed by the router
            assert asyncio.get_running_loop().time() - started < 3
            writer.close()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # serve()'s own way to stop
            await asyncio.wait_for(serving, 10)

    try:
        asyncio.run(main())
    finally:
        gc.unfreeze()  # serve() froze what it had built: this process goes on with other tests
