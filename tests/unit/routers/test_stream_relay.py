"""SseRelay, the sink a streamed decode leg's pieces go to (stream_relay.py): whole events only,
written at once while the client's socket takes them, held for the request's task otherwise."""

import asyncio
import time

import msgspec

from pd_plugins.routers import proxy as proxy_module
from pd_plugins.routers.cli import build_parser, config_from_args
from pd_plugins.routers.flows import Attempt
from pd_plugins.routers.http_server import FastStreamResponse
from pd_plugins.routers.policy import Decision
from pd_plugins.routers.request import parse_request
from pd_plugins.routers.server import Router
from pd_plugins.routers.stream_relay import MAX_HELD_EVENT, SseRelay, whole_events
from pd_plugins.routers.upstream import Pools


class ClientConnection:
    """The front server's connection as FastStreamResponse uses it, its socket a list."""

    http11, keep_alive = True, True
    server = type("Server", (), {"closing": False})()

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.write_paused = self.closed = False

    def head(self, status, headers, framing) -> bytes:
        return b"HEAD|"

    def write(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        self.sent.append(data)

    def response_ended(self) -> None:
        pass


def relay_to(conn: ClientConnection) -> SseRelay:
    return SseRelay(FastStreamResponse(conn, {}), measured=None)


def unchunked(sent: list[bytes]) -> bytes:
    """The events in what was written (chunked framing and the head taken off)."""
    out = b""
    for data in sent:
        data = data.removeprefix(b"HEAD|")
        size, _, rest = data.partition(b"\r\n")
        out += rest[:int(size, 16)]
    return out


def test_whole_events_go_to_the_client_at_once_and_a_cut_one_waits_for_its_end():
    conn = ClientConnection()
    relay = relay_to(conn)
    assert relay(b"data: 1\n\ndata: 2\n\nda") is False  # the reader need not wake
    assert unchunked(conn.sent) == b"data: 1\n\ndata: 2\n\n" and relay.tail == b"da"
    assert relay(b"ta: 3") is False and len(conn.sent) == 1  # nothing whole yet
    assert relay(b"\n\ndata: [DONE]\n\n") is False
    assert unchunked(conn.sent) == b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: [DONE]\n\n"
    assert relay.events == 4 and not relay.pending


def test_a_full_socket_holds_what_follows_for_the_task_and_asks_for_it():
    conn = ClientConnection()
    relay = relay_to(conn)
    conn.write_paused = True  # this write fills the client's socket
    assert relay(b"data: 1\n\n") is True and relay.held and not relay.pending
    assert relay(b"data: 2\n\n") is True  # not written on top of a full socket
    assert relay.pending == [b"data: 2\n\n"] and unchunked(conn.sent) == b"data: 1\n\n"


def test_a_client_gone_under_a_write_is_told_to_the_task():
    conn = ClientConnection()
    relay = relay_to(conn)
    conn.closed = True
    assert relay(b"data: 1\n\n") is True and relay.gone and relay.held


def test_an_answer_not_on_the_front_server_is_always_written_by_the_task():
    relay = SseRelay(object(), measured=None)  # aiohttp's StreamResponse: its writes are coroutines
    assert relay(b"data: 1\n\n") is True and relay.pending == [b"data: 1\n\n"]


def test_an_event_that_never_ends_is_held_only_up_to_a_bound():
    assert whole_events(b"data: 1\r\n\r\ndata: 2") == (b"data: 1\r\n\r\n", b"data: 2")
    endless = b"data: " + b"x" * (MAX_HELD_EVENT + 1)
    assert whole_events(endless) == (endless, b"")  # let through whole: what is held stays bounded


# -- Proxy._relay_stream end to end: a real router's proxy, a scripted decode over loopback ------

EVENTS = [b"data: %d\n\n" % i for i in range(12)] + [b"data: [DONE]\n\n"]


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class SlowClient(ClientConnection):
    """A client that reads, but slowly: its socket is full for `hold_s` after `marker`."""

    def __init__(self, marker: bytes, hold_s: float) -> None:
        super().__init__()
        self.marker, self.hold_s, self.drained = marker, hold_s, asyncio.Event()
        self.drained.set()

    def write(self, data: bytes) -> None:
        super().write(data)
        if self.marker in data and self.drained.is_set():
            self.write_paused = True
            self.drained.clear()

            def readable() -> None:
                self.write_paused = False
                self.drained.set()
            asyncio.get_running_loop().call_later(self.hold_s, readable)

    async def drain(self) -> None:
        await self.drained.wait()


async def relay_through_proxy(monkeypatch, client: ClientConnection, pieces: list[tuple[float, bytes]],
                              idle_s: float, total_s: float):
    """The decode answers with `pieces` ((delay, bytes) after its head); returns the proxy's
    decode worker, how many connections its pool kept and the time the relay took."""
    async def decode(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for delay, data in pieces:
            await asyncio.sleep(delay)
            writer.write(data)
        try:
            await asyncio.sleep(5)  # a stalled stream: the connection stays open
        except asyncio.CancelledError:
            pass

    server = await asyncio.start_server(decode, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    router = Router(config_from_args(build_parser().parse_args(
        ["--decode", f"http://127.0.0.1:{port}", "--policy", "round_robin"])))
    group = router._only_group()
    pools = Pools(1.0)
    await group.start(router.metrics, pools, {}, None)
    proxy = group.proxy
    proxy.timeouts = msgspec.structs.replace(proxy.timeouts, decode_idle_s=idle_s,
                                             decode_total_s=total_s)
    monkeypatch.setattr(proxy_module, "stream_response",
                        lambda http, headers: FastStreamResponse(client, headers))
    request = parse_request(b'{"model": "m", "prompt": "hi", "max_tokens": 12, "stream": true}',
                            "completion", {}, select_model=router.select_model,
                            strip_transfer_fields=False)
    worker = next(iter(group.pool))
    worker.healthy = True
    attempt = Attempt(request, Decision(worker, None, ["test"]), "rid-0", "/v1/completions")
    try:
        started = time.monotonic()
        resp, first = await proxy._decode_first(attempt, {"prompt": "hi"})
        await proxy._relay_stream({}, attempt, resp, first, "route", started, started)
        return worker, len(pools.get(worker.url)._idle), time.monotonic() - started
    finally:
        server.close()
        await pools.close()


def test_a_slow_client_holds_the_stream_without_failing_the_decode(monkeypatch):
    # the decode streams for ~1.5 s; the client's socket is full for 0.6 s after event 3. Its
    # time is not the decode's: neither the idle timeout (0.2 s) nor decode_total_s (1.2 s, less
    # than the decode's own time plus the client's) fires, every event arrives in order, and the
    # leg's connection is kept for the next request.
    events = [b"data: %d\n\n" % i for i in range(24)] + [b"data: [DONE]\n\n"]
    client = SlowClient(b"data: 3\n", 0.6)
    pieces = [(0.06, chunked(event)) for event in events] + [(0.0, b"0\r\n\r\n")]
    worker, kept, took = asyncio.run(relay_through_proxy(monkeypatch, client, pieces, 0.2, 1.2))
    assert unchunked(client.sent) == b"".join(events)
    assert worker.consecutive_failures == 0 and kept == 1
    assert took > 1.2  # the client's wait counted for neither timeout


def test_a_stream_that_stalls_ends_with_an_error_event_after_its_whole_events(monkeypatch):
    client = ClientConnection()
    pieces = [(0.01, chunked(b"data: 0\n\n")), (0.01, chunked(b"data: 1\n\nda"))]  # then silence
    worker, kept, took = asyncio.run(relay_through_proxy(monkeypatch, client, pieces, 0.3, 30))
    sent = unchunked(client.sent)
    assert sent.startswith(b"data: 0\n\ndata: 1\n\ndata: {") and b"mid-stream" in sent
    assert worker.consecutive_failures == 1 and kept == 0 and 0.25 < took < 2


class Done:
    """A decode leg's Response as the relay reads it: whether the stream has ended."""

    done = False


def test_the_piece_that_ends_a_stream_goes_out_with_its_end_in_one_write():
    conn, source = ClientConnection(), Done()
    relay = SseRelay(FastStreamResponse(conn, {}), measured=None, source=source)
    relay(b"data: 1\n\n")
    source.done = True
    relay(b"data: [DONE]\n\n")
    assert conn.sent[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and len(conn.sent) == 2


def test_an_ended_answer_still_says_whether_its_bytes_wait_for_the_client():
    # a stream's last write filled the socket: the caller's wait for it to drain (under
    # client_write_s) must still see it, not an answer that looks written
    conn = ClientConnection()
    out = FastStreamResponse(conn, {})
    assert out.send(b"data: [DONE]\n\n", eof=True) is False
    conn.write_paused = True
    assert out.send(b"") is True and out.send(b"", eof=True) is True
