"""SseRelay, the sink a streamed decode leg's pieces go to (stream_relay.py): whole events only,
written at once while the client's socket takes them, held for the request's task otherwise."""

from pd_plugins.routers.http_server import FastStreamResponse
from pd_plugins.routers.stream_relay import MAX_HELD_EVENT, SseRelay, whole_events


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
