"""The router's lean HTTP client against a real aiohttp server on loopback."""

import asyncio
import socket
import time

import pytest
from aiohttp import web

from pd_plugins.routers.http_client import (MAX_BUFFERED, Upstream, UpstreamError, UpstreamTimeout,
                                            _Conn)
from tests.unit.routers.helpers import loopback_server


async def echo(request):
    return web.Response(body=b"x" * 100_000 + await request.read(),
                        headers={"X-Seen": request.headers.get("X-Request-Id", "")})


def event_stream(count: int, gap_s: float):
    """A handler streaming `count` events `gap_s` apart."""
    async def stream(request):
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(count):
            await out.write(b"data: %d\n\n" % i)
            await asyncio.sleep(gap_s)
        await out.write_eof()
        return out
    return stream


async def late_end(request):
    out = web.StreamResponse()
    await out.prepare(request)
    await out.write(b"first,")
    await asyncio.sleep(0.2)
    await out.write(b"last")
    await out.write_eof()
    return out


def head_then_body(status: int):
    """The head at once, the body 0.3 s later."""
    async def handler(request):
        out = web.StreamResponse(status=status)
        await out.prepare(request)
        await asyncio.sleep(0.3)
        await out.write(b"first")
        await out.write_eof()
        return out
    return handler


async def small(request):
    return web.Response(body=b"ok:" + await request.read())


async def slow(request):
    await asyncio.sleep(2)
    return web.Response(text="late")


async def stall_after_first(request):
    out = web.StreamResponse()
    await out.prepare(request)
    await out.write(b"first")
    await asyncio.sleep(2)
    return out


def run(scenario):
    async def main():
        handlers = {"/echo": echo, "/stream": event_stream(5, 0.01), "/slow": slow,
                    "/stall": stall_after_first,
                    "/small": small, "/late_end": late_end,
                    "/many_events": event_stream(20, 0.01),
                    "/trickle": event_stream(10, 0.1),  # never idle for long, long in all
                    "/head_then_body": head_then_body(200), "/head_then_500": head_then_body(500)}
        async with loopback_server(handlers) as port:
            upstream = Upstream("127.0.0.1", port)
            try:
                await scenario(upstream)
            finally:
                await upstream.close()
    asyncio.run(main())


def test_content_length_body_headers_and_connection_reuse():
    async def scenario(up):
        resp = await up.request("POST", "/echo", b"hello", {"X-Request-Id": "r1"})
        body = await resp.read()
        assert resp.status == 200 and len(body) == 100_005 and body.endswith(b"hello")
        assert resp.header(b"x-seen") == b"r1"
        resp = await up.request("POST", "/echo", b"again")
        assert (await resp.read()).endswith(b"again") and len(up._idle) == 1  # one connection reused
        answers = await asyncio.gather(*[up.request("POST", "/echo", b"%d" % i) for i in range(10)])
        bodies = await asyncio.gather(*[a.read() for a in answers])
        assert all(b.endswith(b"%d" % i) for i, b in enumerate(bodies))
    run(scenario)


def test_chunked_stream_in_pieces():
    async def scenario(up):
        resp = await up.request("GET", "/stream")
        pieces = []
        while chunk := await resp.next_chunk():
            pieces.append(chunk)
        resp.release()
        assert b"".join(pieces) == b"".join(b"data: %d\n\n" % i for i in range(5))
    run(scenario)


def test_a_piped_body_goes_to_its_sink_in_the_connection_callback_and_ends_once(monkeypatch):
    async def scenario(up):
        resp = await up.request("GET", "/many_events", timeout=5)
        first = await resp.next_chunk()
        pieces, wakes = [first], 0
        this_task = asyncio.current_task()

        def sink(piece):
            assert asyncio.current_task() is not this_task  # not the reader's task: a callback
            pieces.append(piece)
            return False

        conn = resp._conn
        wait = type(conn).wait

        async def counted_wait(self):  # each a wake-up of this task
            nonlocal wakes
            wakes += self is conn
            await wait(self)

        monkeypatch.setattr(type(conn), "wait", counted_wait)  # (a connection has slots)
        resp.pipe(sink, idle_s=5, until=time.monotonic() + 30)
        await resp.piped()
        resp.release()
        assert b"".join(pieces) == b"".join(b"data: %d\n\n" % i for i in range(20))
        assert len(pieces) >= 10 and wakes == 1  # pieces one by one; the reader waits once
        assert len(up._idle) == 1  # read to its end: the connection is reused
    run(scenario)


def test_a_sink_that_pauses_stops_the_reading_until_resumed():
    async def scenario(up):
        resp = await up.request("GET", "/many_events", timeout=5)
        pieces = [await resp.next_chunk()]

        def sink(piece):
            pieces.append(piece)
            return True  # the reader has to act on every piece

        resp.pipe(sink, idle_s=5, until=time.monotonic() + 30)
        pauses = 0
        while True:
            await resp.piped()
            if resp.done:
                break
            pauses += 1
            seen = len(pieces)
            await asyncio.sleep(0.05)  # paused: the server's next events wait in TCP
            assert len(pieces) == seen
            resp.resume(time.monotonic() + 30)
        resp.release()
        assert b"".join(pieces) == b"".join(b"data: %d\n\n" % i for i in range(20))
        assert pauses >= 2  # (events that came while paused are read together)
    run(scenario)


def test_a_piped_body_times_out_when_idle_and_when_past_its_deadline():
    async def scenario(up):
        resp = await up.request("GET", "/stall", timeout=5)
        assert await resp.next_chunk() == b"first"
        t0 = time.monotonic()
        resp.pipe(lambda piece: False, idle_s=0.2, until=t0 + 30)
        with pytest.raises(UpstreamTimeout):
            await resp.piped()
        assert 0.15 < time.monotonic() - t0 < 1.5
        resp.release()
        # pieces every 0.1 s for 1 s: each re-arms an idle timeout of 0.3 s, which never fires ...
        resp = await up.request("GET", "/trickle", timeout=5)
        await resp.next_chunk()
        resp.pipe(lambda piece: False, idle_s=0.3, until=time.monotonic() + 30)
        await resp.piped()
        assert resp.done
        resp.release()
        # ... but they do not move the deadline
        resp = await up.request("GET", "/trickle", timeout=5)
        await resp.next_chunk()
        got = []
        t0 = time.monotonic()
        resp.pipe(lambda piece: got.append(piece) and False, idle_s=0.5, until=t0 + 0.45)
        with pytest.raises(UpstreamTimeout):
            await resp.piped()
        assert 0.4 < time.monotonic() - t0 < 1.0 and 2 <= len(got) <= 5
        resp.release()
    run(scenario)


def test_a_piped_answer_that_breaks_raises_from_piped():
    async def scenario(up):
        resp = await up.request("GET", "/stall", timeout=5)
        assert await resp.next_chunk() == b"first"
        resp.pipe(lambda piece: False, idle_s=5, until=time.monotonic() + 30)
        resp._conn.transport.abort()  # the connection dies mid-answer
        with pytest.raises(UpstreamError):
            await resp.piped()
        resp.release()
        assert not up._idle
    run(scenario)


def test_timeouts_and_rearm():
    async def scenario(up):
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await up.request("GET", "/slow", timeout=0.2)
        assert time.monotonic() - t0 < 1
        resp = await up.request("GET", "/stall", timeout=5)
        assert await resp.next_chunk() == b"first"
        resp.rearm(0.2)  # an idle timeout for the rest
        with pytest.raises(UpstreamTimeout):
            await resp.next_chunk()
        resp.release()
    run(scenario)


def test_connection_refused_is_an_upstream_error():
    async def main():
        up = Upstream("127.0.0.1", 1, connect_timeout=1)
        with pytest.raises(UpstreamError):
            await up.request("GET", "/")
    asyncio.run(main())


def test_disarm_stops_the_timeout_until_the_next_rearm():
    async def scenario(up):
        resp = await up.request("GET", "/stall", timeout=0.2)
        assert await resp.next_chunk() == b"first"
        resp.disarm()  # the caller is busy elsewhere (a slow client): not the upstream's time
        await asyncio.sleep(0.5)
        resp.rearm(5)
        assert await resp.next_chunk() == b""  # the rest (nothing) and the end, no timeout
        resp.release()
    run(scenario)


def test_on_sent_is_called_once_the_request_is_written():
    async def scenario(up):
        sent = []
        resp = await up.request("POST", "/echo", b"x", on_sent=lambda: sent.append(True))
        assert sent == [True]
        await resp.read()
    run(scenario)


def test_an_unread_body_is_bounded_and_read_whole_later():
    big = bytes(range(256)) * (40 * 1024)  # 10 MiB

    async def huge(request):
        out = web.StreamResponse()
        await out.prepare(request)
        for i in range(0, len(big), 1 << 16):
            await out.write(big[i:i + (1 << 16)])
        await out.write_eof()
        return out

    async def main():
        async with loopback_server({"/huge": huge}) as port:
            up = Upstream("127.0.0.1", port)
            try:
                resp = await up.request("GET", "/huge", timeout=30)
                await asyncio.sleep(0.5)  # the reader is behind: the client stops reading
                conn = resp._conn
                assert conn.paused and conn.buffered <= MAX_BUFFERED + (1 << 18)
                pieces = []
                while chunk := await resp.next_chunk():
                    pieces.append(chunk)
                assert b"".join(pieces) == big
                resp.release()
                again = await up.request("GET", "/huge", timeout=30)
                assert await again.read() == big  # read() takes a paused body whole too
                status, _, body = await up.exchange(up.json_request("/huge", b"", "r1"), 30)
                assert status == 200 and body == big  # its reader takes it whole at the end
                assert not up._idle[-1].paused  # and its connection never stopped reading
            finally:
                await up.close()
    asyncio.run(main())


def test_rearm_moves_the_deadline_both_ways_and_disarm_holds_it():
    async def scenario(upstream):
        resp = await upstream.request("GET", "/stall", timeout=5)
        assert await resp.next_chunk() == b"first"
        resp.rearm(5)
        resp.rearm(0.2)  # shorter than the pending timer: it must fire at 0.2 s, not 5 s
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await resp.next_chunk()
        assert time.monotonic() - t0 < 1.0
        resp.release()

        resp = await upstream.request("GET", "/stall", timeout=0.3)
        assert await resp.next_chunk() == b"first"
        resp.disarm()  # the first timer (0.3 s) is cancelled too
        await asyncio.sleep(0.5)
        resp.rearm(0.2)
        for _ in range(3):  # a timer that fires before the moved deadline waits for it
            await asyncio.sleep(0.1)
            resp.rearm(0.2)
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await resp.next_chunk()
        assert 0.15 < time.monotonic() - t0 < 1.0
        resp.release()
    run(scenario)


@pytest.mark.parametrize("api", ["request", "exchange"])
@pytest.mark.parametrize("path, answer", [
    ("/small", b"ok:hi"),                  # one read: the reader waits for the headers (_sent)
    ("/echo", b"x" * 100_000 + b"hi"),    # a large answer
    ("/late_end", b"first,last"),         # request(): the reader is in read(), a part taken
])
def test_an_answer_whose_reader_is_cancelled_as_it_arrives_goes_to_on_orphan(monkeypatch, path, answer,
                                                                              api):
    """The race pd-router's prefill leg has with a client that leaves: the answer is complete,
    the reading task is cancelled before it resumes. The answer is handed over whole, and the
    connection is closed, not pooled."""
    orphans = []

    async def scenario(up):
        task = None
        original = _Conn.data_received

        def data_received(conn, data):
            original(conn, data)
            if conn.done and task is not None:
                task.cancel()  # in the same loop turn as the answer's last bytes

        monkeypatch.setattr(_Conn, "data_received", data_received)

        async def leg():
            orphan = lambda status, body: orphans.append((status, body))  # noqa: E731
            if api == "exchange":
                return await up.exchange(up.json_request(path, b"hi", "r1"), 5, on_orphan=orphan)
            resp = await up.request("POST", path, b"hi", on_orphan=orphan)
            return await resp.read()

        task = asyncio.create_task(leg())
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not up._idle

    run(scenario)
    assert orphans == [(200, answer)]


@pytest.mark.parametrize("api", ["request", "exchange"])
def test_a_reader_cancelled_before_its_answer_is_complete_orphans_nothing(api):
    orphans = []

    async def scenario(up):
        async def leg():
            orphan = lambda *a: orphans.append(a)  # noqa: E731
            if api == "exchange":
                return await up.exchange(up.json_request("/stall", b"", "r1"), 5, on_orphan=orphan)
            resp = await up.request("POST", "/stall", b"", on_orphan=orphan)
            return await resp.read()

        task = asyncio.create_task(leg())
        await asyncio.sleep(0.3)  # headers and "first" are in, the rest never comes
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not up._idle  # the leg's connection is closed: the server sees the client leave

    run(scenario)
    assert orphans == []


def test_exchange_returns_the_whole_answer_and_pools_the_connection():
    async def scenario(up):
        status, headers, body = await up.exchange(up.json_request("/echo", b"hello", "r-1"), 5)
        assert status == 200 and body == b"x" * 100_000 + b"hello"
        assert (b"X-Seen", b"r-1") in headers
        assert len(up._idle) == 1
        conn = up._idle[-1]
        status, _, body = await up.exchange(up.json_request("/small", b"again", "r-2"), 5)
        assert (status, body) == (200, b"ok:again") and up._idle[-1] is conn  # reused
        sent = []
        await up.exchange(up.json_request("/small", b"", "r-3"), 5, on_sent=lambda: sent.append(1))
        assert sent == [1]
    run(scenario)


def test_a_shut_pool_closes_its_idle_connections_and_each_one_in_use_when_it_is_done():
    async def scenario(up):
        await asyncio.gather(*(up.exchange(up.json_request("/small", b"", f"r-{i}"), 5)
                               for i in range(2)))  # two connections, both idle now
        answer = await up.request("POST", "/late_end", b"", timeout=5)  # in use across the shut
        idle = up._idle[-1]
        in_use = answer._conn
        up.shut()
        assert not up._idle and idle.closed
        assert await answer.read() == b"first,last"  # the request in flight finishes
        assert not up._idle and in_use.closed  # and its connection is not pooled again
    run(scenario)


def test_a_whole_answer_past_its_bound_fails_the_exchange(monkeypatch):
    from pd_plugins.routers import http_client

    monkeypatch.setattr(http_client, "MAX_ANSWER_BYTES", 50_000)  # /echo answers 100 kB

    async def scenario(up):
        with pytest.raises(UpstreamError, match="answer larger than 50000 bytes"):
            await up.exchange(up.json_request("/echo", b"", "r-1"), 5)
        assert not up._idle  # that connection is closed, not pooled
        status, _, body = await up.exchange(up.json_request("/small", b"x", "r-2"), 5)
        assert (status, body) == (200, b"ok:x")
    run(scenario)


def test_exchange_timeouts_name_the_one_that_ran_out():
    async def scenario(up):
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout) as first_byte:
            await up.exchange(up.json_request("/slow", b"", "r-1"), 0.2, body_timeout=5)
        assert first_byte.value.timeout_s == 0.2 and "did not answer" in str(first_byte.value)
        with pytest.raises(UpstreamTimeout) as body:  # headers in time, the body stalls
            await up.exchange(up.json_request("/stall", b"", "r-2"), 5, body_timeout=0.2)
        assert body.value.timeout_s == 0.2 and "no data" in str(body.value)
        assert time.monotonic() - t0 < 2.0
        assert not up._idle  # a timed-out connection is closed, not pooled
    run(scenario)


def test_exchange_error_answers_keep_their_status_and_the_first_timeout():
    """A non-200 answer's body comes under the first timeout (not the body's, which is for a 200
    answer), and one whose body fails still returns its status (empty body): the caller decides
    by the status whether the request or the worker is at fault."""
    async def stalled_error(request):
        out = web.StreamResponse(status=400)
        await out.prepare(request)
        await out.write(b"partial")
        await asyncio.sleep(2)
        return out

    async def refused(request):
        return web.json_response({"error": "bad"}, status=400)

    async def main():
        async with loopback_server({"/stalled_error": stalled_error, "/refused": refused}) as port:
            up = Upstream("127.0.0.1", port)
            try:
                status, headers, body = await up.exchange(up.json_request("/refused", b"", "r1"), 5)
                assert status == 400 and b"bad" in body
                t0 = time.monotonic()
                status, _, body = await up.exchange(up.json_request("/stalled_error", b"", "r2"),
                                                    0.3, body_timeout=30)
                assert (status, body) == (400, b"") and time.monotonic() - t0 < 1.5
                assert not up._idle  # the connection whose answer failed is closed, not pooled
            finally:
                await up.close()
    asyncio.run(main())


def test_exchange_retries_once_on_a_keep_alive_connection_the_server_closed():
    """The keep-alive race: the server closes a pooled connection as the next request goes out
    on it. The request goes again on another connection; twice is an error."""
    answered = []

    async def serve(reader, writer):
        first = True
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            if not first:  # a second request on this connection: closed without a byte
                writer.close()
                return
            first = False
            answered.append(1)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        up = Upstream("127.0.0.1", port)
        try:
            for api in ("exchange", "request"):
                for i in range(3):
                    if api == "exchange":
                        status, _, body = await up.exchange(up.json_request("/x", b"{}", "r"), 5)
                    else:
                        resp = await up.request("POST", "/x", b"{}", timeout=5)
                        status, body = resp.status, await resp.read()
                    assert (status, body) == (200, b"ok")
            assert len(answered) == 6  # each on a fresh connection after the first
        finally:
            await up.close()
            server.close()
            await server.wait_closed()
    asyncio.run(main())


class RawServer:
    """A loopback server whose answers are raw bytes (what aiohttp would never send): `answer(n)`
    gives the bytes for the n-th request on the server (from 0), None to close the connection
    after `close_after_s` without answering. It counts requests and connections."""

    def __init__(self, answer, close_after_s: float = 0.0):
        self.answer, self.close_after_s = answer, close_after_s
        self.requests = self.connections = 0

    async def __aenter__(self):
        async def serve(reader, writer):
            self.connections += 1
            try:
                while await reader.readuntil(b"\r\n\r\n"):
                    n, self.requests = self.requests, self.requests + 1
                    data = self.answer(n)
                    if data is None:
                        await asyncio.sleep(self.close_after_s)
                        break
                    writer.write(data)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return Upstream("127.0.0.1", self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc):
        self.server.close()


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)


def test_an_interim_answer_is_skipped_and_the_real_one_returned():
    async def main():
        async with RawServer(lambda n: b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
                                       + ok(b"REAL")) as up:
            status, headers, body = await up.exchange(up.json_request("/a", b"{}", "r"), 5)
            assert (status, body) == (200, b"REAL") and (b"Link", b"</x>") not in headers
            assert len(up._idle) == 1
    asyncio.run(main())


def test_bytes_past_the_end_of_an_answer_never_reach_the_next_one():
    async def main():
        server = RawServer(lambda n: ok(b"ONE") + ok(b"EXTRA") if n == 0 else ok(b"TWO"))
        async with server as up:
            status, _, body = await up.exchange(up.json_request("/a", b"{}", "r1"), 5)
            assert (status, body) == (200, b"ONE") and not up._idle  # closed, not pooled
            status, _, body = await up.exchange(up.json_request("/a", b"{}", "r2"), 5)
            assert (status, body) == (200, b"TWO") and server.connections == 2
    asyncio.run(main())


def test_a_reused_connection_dropped_after_the_request_went_out_is_not_sent_again():
    # the server may have begun it (a decode generating): a second send is a second generation
    async def main():
        server = RawServer(lambda n: ok(b"warm") if n == 0 else None, close_after_s=0.5)
        async with server as up:
            await up.exchange(up.json_request("/a", b"{}", "r1"), 5)  # pooled: the next reuses it
            with pytest.raises(UpstreamError):
                await up.exchange(up.json_request("/a", b"{}", "r2"), 5)
            assert server.requests == 2  # not 3
    asyncio.run(main())


def test_a_connection_idle_past_the_servers_keep_alive_is_not_reused(monkeypatch):
    from pd_plugins.routers import http_client

    monkeypatch.setattr(http_client, "MAX_IDLE_S", 0.05)

    async def main():
        server = RawServer(lambda n: ok(b"x"))
        async with server as up:
            await up.exchange(up.json_request("/a", b"{}", "r1"), 5)
            await asyncio.sleep(0.1)
            await up.exchange(up.json_request("/a", b"{}", "r2"), 5)
            assert server.connections == 2
    asyncio.run(main())


class EndlessServer:
    """A loopback server that answers each request with `start`, then `filler` over and over
    (64 KiB writes) until the client drops the connection or `total` bytes went out; `sent`: how
    many did."""

    def __init__(self, start: bytes, filler: bytes, total: int = 48 << 20):
        self.start, self.filler, self.total = start, filler, total
        self.sent = 0

    async def __aenter__(self):
        async def serve(reader, writer):
            try:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(self.start)
                piece = self.filler * max(1, 65536 // len(self.filler))
                while self.sent < self.total:
                    writer.write(piece)
                    await writer.drain()
                    self.sent += len(piece)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return Upstream("127.0.0.1", self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc):
        self.server.close()


@pytest.mark.parametrize("start, filler, words", [
    (b"HTTP/1.1 200 OK\r\n", b"X-Many: v\r\n", "more than 128 headers"),
    (b"HTTP/1.1 200 OK\r\nX-Long: ", b"v", "head"),
    # trailers after a small chunked body: the parser builds their value in memory
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-Trailer: ", b"v",
     "trailers"),
])
def test_a_head_or_trailers_past_their_bounds_fail_the_answer(start, filler, words):
    # before the bounds, the router took every header a worker sent (a million of them: +345 MiB)
    async def main():
        server = EndlessServer(start, filler)
        async with server as up:
            with pytest.raises(UpstreamError, match=words):
                async with asyncio.timeout(20):
                    resp = await up.request("POST", "/a", b"{}", timeout=20)
                    await resp.read()
            assert server.sent < 8 << 20  # dropped early, not read to the end
    asyncio.run(main())


@pytest.mark.parametrize("headers, body_lines, words", [
    (129, 0, "more than 128 headers"), (127, 0, None),
    (127, 5000, None),  # the body's newlines are not the head's
])
def test_an_answer_read_whole_in_one_read_has_its_headers_counted_in_its_head(headers, body_lines,
                                                                            words):
    body = b"\n" * body_lines + b"{}"
    answer = (b"HTTP/1.1 200 OK\r\n" + b"X-Many: v\r\n" * headers
              + b"Content-Length: %d\r\n\r\n" % len(body) + body)

    async def main():
        async with RawServer(lambda n: answer) as up:
            if words is None:
                status, _, got = await up.exchange(up.json_request("/a", b"{}", "r"), 5)
                assert status == 200 and got == body
            else:
                with pytest.raises(UpstreamError, match=words):
                    await up.exchange(up.json_request("/a", b"{}", "r"), 5)
    asyncio.run(main())


def test_an_error_answers_body_is_read_only_up_to_its_bound():
    # a 500 whose chunked body never ends: read() took it piece by piece (MAX_BUFFERED never held
    # it), and the router grew by gigabytes
    from pd_plugins.routers import upstream as legs

    class Worker:
        removed = False

    async def main():
        endless = (b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n",
                   b"10000\r\n" + b"e" * 65536 + b"\r\n")
        server = EndlessServer(*endless)
        async with server as up:
            resp = await up.request("POST", "/a", b"{}", timeout=20)
            assert resp.status == 500
            with pytest.raises(UpstreamError, match="larger than 65536 bytes"):
                async with asyncio.timeout(20):
                    await resp.read()  # an error answer's default bound
        assert server.sent < 8 << 20
        for leg in (legs.open_leg, legs.whole_leg):  # both kinds of leg: the status decides
            server = EndlessServer(*endless)
            async with server as up:
                worker = Worker()
                worker.url = f"http://127.0.0.1:{up.port}"
                pools = legs.Pools(2.0)
                with pytest.raises(legs.WorkerFailed, match="HTTP 500"):
                    async with asyncio.timeout(20):
                        await leg(pools, worker, "decode", "/v1/completions", {}, "r", 20.0)
                await pools.close()
            assert server.sent < 8 << 20, leg
    asyncio.run(main())


def test_an_answer_that_switches_protocols_is_an_upstream_error_not_a_logged_crash(caplog):
    async def main():
        async with RawServer(lambda n: b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n"
                                       b"Connection: Upgrade\r\n\r\nPRI * HTTP/2.0") as up:
            with pytest.raises(UpstreamError, match="switched protocols"):
                await up.exchange(up.json_request("/a", b"{}", "r"), 5)
            await asyncio.sleep(0.05)
    caplog.set_level("ERROR")
    asyncio.run(main())
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_a_refusal_with_a_content_type_that_is_not_utf8_is_passed_on():
    from pd_plugins.routers import upstream as legs

    class Worker:
        removed = False

    async def main():
        body = b'{"error": "bad"}'
        async with RawServer(lambda n: b"HTTP/1.1 400 Bad\r\nContent-Type: \xff\xfe\r\n"
                                       b"Content-Length: %d\r\n\r\n%b" % (len(body), body)) as up:
            worker = Worker()
            worker.url = f"http://127.0.0.1:{up.port}"
            pools = legs.Pools(2.0)
            for leg in (legs.open_leg, legs.whole_leg):
                with pytest.raises(legs.RequestRefused) as refused:
                    await leg(pools, worker, "decode", "/v1/completions", {}, "r", 5.0)
                assert refused.value.status == 400 and refused.value.body == body
                assert refused.value.content_type == "\xff\xfe"
            await pools.close()
    asyncio.run(main())


def test_first_body_returns_a_200_answer_with_its_first_piece_and_any_other_at_its_head():
    # a streamed leg's reader is woken once, at the first piece (open_leg), not also at the head
    async def scenario(up):
        for first_body, path, waited, status in ((False, "/head_then_body", False, 200),
                                                 (True, "/head_then_body", True, 200),
                                                 (True, "/head_then_500", False, 500)):
            began = time.monotonic()
            resp = await up.open(up.json_request(path, b"{}", "r"), 5, first_body=first_body)
            assert resp.status == status
            assert (time.monotonic() - began >= 0.25) is waited, (first_body, path)
            if waited:  # the piece is there: no wait for it
                async with asyncio.timeout(0.05):
                    assert await resp.next_chunk() == b"first"
            assert await resp.read() in (b"", b"first")
    run(scenario)


# -- Leg: a request sent from a callback, its answer reported to a callback -------------------

async def leg_answer(up: Upstream, timeout: float = 5.0, **kwargs):
    """Send one leg; the Leg once its on_answer was called."""
    done = asyncio.get_running_loop().create_future()
    up.leg(up.json_request("/a", b"{}", "r"), timeout, done.set_result, **kwargs)
    return await asyncio.wait_for(done, 5)


def test_a_leg_reports_its_whole_answer_and_its_connection_is_reused():
    async def main():
        server = RawServer(lambda n: ok(b"ONE" if n == 0 else b"TWO"))
        async with server as up:
            leg = await leg_answer(up, whole=True)
            assert leg.error is None and leg.conn.status == 200 and leg.body() == b"ONE"
            leg = await leg_answer(up, whole=True)
            assert leg.body() == b"TWO" and server.connections == 1 and len(up._idle) == 1
    asyncio.run(main())


def test_a_leg_retries_the_keep_alive_race_once_on_a_fresh_connection():
    # the pooled connection is closed by the server as the request goes out (no byte back):
    # sent again on a new connection, as exchange() does
    async def main():
        server = RawServer(lambda n: None if n == 1 else ok(b"x%d" % n))
        async with server as up:
            assert (await leg_answer(up, whole=True)).body() == b"x0"
            leg = await leg_answer(up, whole=True)
            assert leg.error is None and leg.body() == b"x2"
            assert server.requests == 3 and server.connections == 2
    asyncio.run(main())


def test_a_leg_that_cannot_connect_or_times_out_reports_its_error():
    async def main():
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
        free.close()  # nothing listens there
        leg = await leg_answer(Upstream("127.0.0.1", port), whole=True)
        assert isinstance(leg.error, UpstreamError) and "cannot connect" in str(leg.error)
        async with RawServer(lambda n: None, close_after_s=2.0) as up:  # never answers
            leg = await leg_answer(up, timeout=0.2, whole=True)
            assert isinstance(leg.error, UpstreamTimeout) and leg.error.timeout_s == 0.2
    asyncio.run(main())


def test_an_opened_leg_reports_a_200_at_its_first_piece_and_an_error_answer_whole():
    async def main():
        async with RawServer(lambda n: ok(b"first")) as up:
            leg = await leg_answer(up, first_body=True)
            assert leg.conn.status == 200 and leg.response().arrived() == b"first"
        error = (b"HTTP/1.1 500 X\r\nContent-Length: 10\r\n\r\n12345", b"67890")

        async def serve(reader, writer):  # an error answer whose body comes in two pieces
            await reader.readuntil(b"\r\n\r\n")
            writer.write(error[0])
            await asyncio.sleep(0.2)
            writer.write(error[1])
            await asyncio.sleep(1)
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        up = Upstream("127.0.0.1", server.sockets[0].getsockname()[1])
        leg = await leg_answer(up, first_body=True)
        assert leg.conn.status == 500 and leg.body() == b"1234567890"  # its reason, whole
        server.close()
    asyncio.run(main())


def test_a_leg_cancelled_while_its_connection_opens_sends_nothing():
    async def main():
        server = RawServer(lambda n: ok(b"x"))
        async with server as up:
            called = []
            leg = up.leg(up.json_request("/a", b"{}", "r"), 5, called.append, whole=True)
            assert leg.connecting is not None  # no idle connection: one is being opened
            leg.cancel()
            await asyncio.sleep(0.2)
            assert called == [] and server.requests == 0 and not leg.sent
    asyncio.run(main())


def test_a_leg_answer_complete_before_bytes_past_its_end_is_the_answer():
    # as exchange() returns it: the answer is whole; the connection is dropped, not pooled
    async def main():
        server = RawServer(lambda n: ok(b"ONE") + b"garbage after the end")
        async with server as up:
            leg = await leg_answer(up, whole=True)
            assert leg.error is None and leg.conn.status == 200 and leg.body() == b"ONE"
            assert not up._idle
    asyncio.run(main())
