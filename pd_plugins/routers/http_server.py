"""pd-router's front HTTP/1.1 server: inference requests on asyncio.Protocol + httptools,
everything else handed to the aiohttp app.

Why: aiohttp's server costs more CPU per PD request than the rest of the router together
(docs/benchmarks.md, "Choosing the router's HTTP stack"); the two inference endpoints carry nearly
all traffic, so they are served here with the same C parser (llhttp) the legs' client uses
(http_client.py), and the admin API, /metrics, /ready, /v1/models and the rest stay on aiohttp,
unchanged.

Per connection: while no request is in progress, the first bytes of the next one decide. A request
line `POST /v1/completions` or `POST /v1/chat/completions` is served here; anything else hands the
connection (with the bytes read so far) to aiohttp's own protocol for good: a client that mixes
calls on one connection is served correctly, the later inference calls at aiohttp's cost. Requests
pipelined behind an inference request in the same read are served here if they are inference
requests too, and answered 400 otherwise (no mainstream client pipelines).

Limits, as aiohttp's and tighter: the body (413 past `max_body`, answered at once and the
connection closed), the request line (414) and the headers (431: more than MAX_HEADERS names,
counted at the end of each read and of the message, trailers included, or more than
MAX_HEADER_BYTES at the head's end; a repeated name keeps its first value, the later ones are
dropped as they are read and bounded with the head's bytes), both answered as soon as they are
crossed (a head that never ends is never buffered past its limit), a chunked body's framing
and trailers (400 once they pass MAX_HEAD_BYTES plus a little per chunk, and chunks that average
under MAX_CHUNK_OVERHEAD body bytes: httptools builds a trailer's value in memory, and each
chunk costs a callback), one timeout for reading a
request once it has begun (408, a request that began behind an answered one included), one
for an idle keep-alive connection (KEEPALIVE_TIMEOUT_S, aiohttp's side too: server.py gives it
to its AppRunner), and `max_connections` client connections open at once, those handed to
aiohttp included (one more is answered 503 and closed at once). A client that
disconnects cancels its handler (the proxy closes both legs); writes wait for the socket to drain
(flow control), so a client that does not read holds back its own answer, never the router.

The handler is called as soon as a request is read. It returns an awaitable, run in the request's
task, or a CallbackAnswer (the proxy's exchange.py), which answers from callbacks: it writes
through the connection, ends with answer_ended(), or hands what must wait to a task with run();
a client that disconnects meanwhile is its client_gone().
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
from typing import Any, Awaitable, Callable, Union

import httptools
from aiohttp import web

from pd_plugins.routers.deadline import Deadline
from pd_plugins.routers.errors import error_body, error_response

log = logging.getLogger("pd_router.http")

__all__ = ["CallbackAnswer", "FrontServer", "FastRequest", "FastStreamResponse", "answered",
           "body_too_slow", "header_lines", "header_map", "read_body", "stream_response"]

# The request lines served here (the path may carry a query string, as aiohttp's routes allow).
HOT_REQUEST_LINE = re.compile(rb"POST /v1/(?:chat/)?completions[ ?]")
HOT_PATHS = ("/v1/completions", "/v1/chat/completions")
DECIDE_BYTES = len(b"POST /v1/chat/completions ")  # enough of a request line to decide

MAX_URL_BYTES = 8190  # aiohttp's max_line_size
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 128  # names (a repeated one counts once: only its first value is kept)
# A request's head (request line and headers) past this is refused as it arrives: httptools keeps
# a header value until its line ends, so counting whole headers alone would not bound it.
MAX_HEAD_BYTES = MAX_URL_BYTES + MAX_HEADER_BYTES + 4096
# A chunked body: each chunk's size line and end (and extensions) may take this many bytes, and
# beyond the first FREE_CHUNKS chunks they must average this many body bytes; trailers come under
# MAX_HEAD_BYTES with the framing (and count as headers).
MAX_CHUNK_OVERHEAD = 64
FREE_CHUNKS = 1024
READ_TIMEOUT_S = 60.0  # a request's first byte to its last
# an idle keep-alive connection, here and on the aiohttp side (server.py gives it to its
# AppRunner: aiohttp's own default is 3630 s)
KEEPALIVE_TIMEOUT_S = 75.0
# client connections open at once, here and handed to aiohttp together (config.py:
# max_connections); one more is answered 503 and closed at once
MAX_CONNECTIONS = 10_000
REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
STATUS_LINES = {status: b"HTTP/1.1 %d %b\r\n" % (status, reason) for status, reason in REASONS.items()}


class RequestHeaders:
    """A request's headers, looked up by name case-insensitively (the first of a repeated one, as
    aiohttp's CIMultiDict.get does; values decoded as aiohttp decodes them), over the name map
    the front server builds once per request (`header_map`)."""

    __slots__ = ("_by_name",)

    def __init__(self, by_name: dict[bytes, bytes]) -> None:
        self._by_name = by_name

    def get(self, name: str, default: Any = None) -> Any:
        key = _KEYS.get(name)
        if key is None:
            key = name.lower().encode("latin-1")
            if len(_KEYS) < MAX_HEADERS:  # the router's own names: a handful
                _KEYS[name] = key
        value = self._by_name.get(key)
        return default if value is None else value.decode("utf-8", "surrogateescape")

    def has_any(self, names: frozenset[bytes]) -> bool:
        """Whether any of these (lower-cased) header names is there: one test in C."""
        return not names.isdisjoint(self._by_name)

    def __getitem__(self, name: str) -> str:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None


_KEYS: dict[str, bytes] = {}  # a header name as the code spells it -> its lower-cased bytes


def header_map(fields: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """Lower-cased header names to their first value, from a head's fields as read (names as
    sent, the first value of each: _FrontConnection.fields). In C: no Python per header."""
    return dict(zip(map(bytes.lower, reversed(fields)), reversed(fields.values())))


def header_lines(headers: Any) -> bytes:
    """A name -> value mapping as a response head's lines (latin-1, as HTTP's header bytes)."""
    return "".join([f"{name}: {value}\r\n" for name, value in headers.items()]).encode(
        "latin-1", "replace")


class FastRequest:
    """What pd-router's inference handler reads of a request (the subset of aiohttp's
    web.Request it uses: path, headers, read(), remote, transport, and per-request state)."""

    __slots__ = ("path", "query_string", "headers", "version", "keep_alive", "_body",
                 "_too_large", "_state", "conn")
    method = "POST"  # (the only method served here)

    def __init__(self, conn: _FrontConnection, path: str, query_string: str,
                 headers: RequestHeaders, version: str, keep_alive: bool, body: bytes,
                 too_large: int) -> None:
        self.path, self.query_string, self.headers = path, query_string, headers
        self.version, self.keep_alive, self.conn = version, keep_alive, conn
        self._body, self._too_large = body, too_large
        self._state: dict[str, Any] | None = None

    @property
    def remote(self) -> str | None:
        return self.conn.remote

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.conn.transport

    async def read(self) -> bytes:
        return self.body()

    def body(self) -> bytes:
        """The body, read already (read() without a wait)."""
        if self._too_large:  # what aiohttp raises past client_max_size: the handler answers 413
            raise web.HTTPRequestEntityTooLarge(max_size=self.conn.server.max_body,
                                                actual_size=self._too_large)
        return self._body

    # per-request state (aiohttp's request[key]): a dict made only when something is stored
    def __getitem__(self, key: str) -> Any:
        if self._state is None:
            raise KeyError(key)
        return self._state[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if self._state is None:
            self._state = {}
        self._state[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        return default if self._state is None else self._state.get(key, default)


class FastStreamResponse:
    """A response written piece by piece (aiohttp's StreamResponse's calls the proxy makes):
    chunked unless `content_length` is set before prepare()."""

    __slots__ = ("status", "headers", "content_length", "_conn", "_chunked", "_head", "prepared",
                 "_ended")

    def __init__(self, conn: _FrontConnection, headers: Any, status: int = 200) -> None:
        """`headers`: a name -> value mapping, or its lines as bytes already (header_lines)."""
        self.status, self.headers, self._conn = status, headers, conn
        self.content_length: int | None = None
        self.prepared = self._ended = self._chunked = False
        self._head = b""  # the status line and headers until the first write sends them

    async def prepare(self, request: FastRequest | None = None) -> None:
        self._prepare()

    def _prepare(self) -> None:
        """The status line and headers, sent with the first piece of the body (one write)."""
        if self.prepared:
            return
        self.prepared = True
        conn = self._conn
        framing = None
        if self.content_length is not None:
            framing = b"Content-Length: %d\r\n" % self.content_length
        elif conn.http11:
            self._chunked = True
            framing = b"Transfer-Encoding: chunked\r\n"
        else:  # HTTP/1.0 without a length: the body ends with the connection
            conn.keep_alive = False
        self._head = conn.head(self.status, self.headers, framing)

    def send(self, data: bytes, eof: bool = False) -> bool:
        """Hand `data` (and the end, if `eof`) to the socket without waiting; True if the socket
        is full and the caller should await drained() before writing more."""
        if self._ended:  # (whether what was written still waits for the client)
            return self._conn.write_paused
        self._prepare()
        if data and self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        if eof:
            self._ended = True
            if self._chunked:
                data += b"0\r\n\r\n"
        if self._head:
            data, self._head = self._head + data, b""
        conn = self._conn
        if data:
            conn.write(data)
        if eof:
            conn.response_ended()
        return conn.write_paused

    async def drained(self) -> None:
        await self._conn.drain()

    async def write(self, data: bytes) -> None:
        if data and self.send(data):
            await self._conn.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        if not self._ended and self.send(data, eof=True):
            await self._conn.drain()


async def read_body(request: web.BaseRequest) -> bytes:
    """An aiohttp request's body within READ_TIMEOUT_S (TimeoutError past it): aiohttp times out
    only idle connections, so a client could hold one of its handlers forever by never finishing
    a body. (The front server times out a request's reading itself, 408, and hands the handler
    its body read: FastRequest.body().)"""
    async with asyncio.timeout(READ_TIMEOUT_S):
        return await request.read()


def body_too_slow() -> web.Response:
    """The answer to read_body's TimeoutError: 408, and the connection closed."""
    response = error_response(408, f"the request body was not received within {READ_TIMEOUT_S:g} s")
    response.force_close()
    return response


async def answered(response: Any) -> Any:
    """An answer made already, as the awaitable a handler hands back."""
    return response


# A client's request and the answer to it, whichever server read it (this one, or aiohttp's for
# what it leaves to it): a handler's parameter and return types (compiled, an annotation naming
# FastRequest alone would refuse aiohttp's request at run time: native.py)
ClientHttp = Union[web.Request, FastRequest]
ClientOut = Union[web.StreamResponse, FastStreamResponse]


def stream_response(request: Any, headers: Any) -> ClientOut:
    """A streamed answer for `request`, whichever server read it (`headers` a mapping; for the
    front server's, also its lines as bytes: header_lines)."""
    if isinstance(request, FastRequest):
        return FastStreamResponse(request.conn, headers)
    return web.StreamResponse(headers=headers)


class CallbackAnswer:
    """A request answered from callbacks, not by a task (the proxy's exchange.py). Made by the
    handler, which returns it, it takes the connection's request at once (before anything of it
    can end) and owns it until it gives it back: it writes the answer through the connection
    (a FastStreamResponse, or send_whole() or respond() for a whole answer) and then calls
    answer_ended(); or it hands what must wait to a task with run(), which owns the rest
    (client_gone is no longer called: the task is cancelled instead); or it gives up with drop()
    (the client is leaving) or answer_failed() (a bug: 500, or the connection closed)."""

    __slots__ = ()

    def __init__(self, conn: _FrontConnection) -> None:
        conn.callbacks = self

    def client_gone(self) -> None:
        """The client's connection closed before the answer ended."""
        raise NotImplementedError


# returns an awaitable of a web.Response or FastStreamResponse (run in the request's task), or a
# CallbackAnswer
Handler = Callable[[FastRequest], "Awaitable[Any] | CallbackAnswer"]
Authorize = Callable[[str, str], "web.Response | None"]  # (path, Authorization) -> a refusal


class FrontServer:
    """The listening socket's protocol factory: one _FrontConnection per client connection."""

    def __init__(self, handler: Handler, fallback: Any, *,
                 max_body: int, authorize: Authorize | None = None,
                 read_timeout_s: float = READ_TIMEOUT_S,
                 keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        # fallback: aiohttp's web.Server (a protocol factory that lists its `connections`)
        self.handler, self.fallback, self.authorize = handler, fallback, authorize
        self.max_body, self.max_connections = max_body, max_connections
        self.read_timeout_s, self.keepalive_timeout_s = read_timeout_s, keepalive_timeout_s
        self.connections: set[_FrontConnection] = set()
        self.refused_connections = 0  # past max_connections
        self.closing = False

    def full(self) -> bool:
        # aiohttp's public list of its connections (a copy: few, the admin and scrapers')
        return (len(self.connections) + len(self.fallback.connections)
                >= self.max_connections)

    def __call__(self) -> _FrontConnection:
        return _FrontConnection(self)

    async def shutdown(self, timeout_s: float) -> None:
        """Close idle connections now; let requests in progress finish, up to `timeout_s`."""
        self.closing = True
        for conn in list(self.connections):
            if not conn.answering:
                conn.close()
        until = asyncio.get_running_loop().time() + timeout_s
        while any(c.answering for c in self.connections) and asyncio.get_running_loop().time() < until:
            await asyncio.sleep(0.05)  # (answers end in tasks and in callbacks alike)
        for conn in list(self.connections):
            conn.close()


class _FrontConnection(asyncio.Protocol):
    # Slots: with more than 30 attributes, CPython 3.11 gives an instance a dict of its own, and
    # then neither its attribute reads nor its method calls specialize (docs/benchmarks.md).
    __slots__ = ("server", "loop", "transport", "remote", "fields", "on_header", "parser",
                 "undecided", "held", "queue", "task", "callbacks", "deadline", "in_message",
                 "keep_alive", "http11", "closed", "handed_off", "write_paused", "drain_waiter",
                 "too_large", "unread", "refusal", "_started", "in_head", "url", "body",
                 "body_bytes", "message_bytes", "chunks", "by_name", "path", "query", "ended")

    def __init__(self, server: FrontServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.remote: str | None = None
        # A request's header fields as httptools reports them (names as sent, the first value of
        # each): its on_header callback is this dict's setdefault, so a header costs no Python
        # (bounded in _consume and on_headers_complete, not per header)
        self.fields: dict[bytes, bytes] = {}
        self.on_header = self.fields.setdefault
        self.parser = httptools.HttpRequestParser(self)
        self.undecided = b""  # bytes of a request line not yet long enough to decide on
        self.held: list[bytes] = []  # data that arrived while a request was being answered
        # parsed requests (a str: a refusal to send; a web.Response: the one authorize gave)
        self.queue: list[FastRequest | str | web.Response] = []
        self.task: asyncio.Task | None = None  # the task answering the request, if one does
        self.callbacks: CallbackAnswer | None = None  # or what answers it from callbacks
        self.deadline = Deadline(self.loop, self._timed_out)  # the read or keep-alive timeout
        self.in_message = False
        self.keep_alive = True
        self.http11 = True
        self.closed = False
        self.handed_off = False
        self.write_paused = False
        self.drain_waiter: asyncio.Future | None = None
        # A request's state, set at its first byte (on_message_begin) and its head's end
        # (on_headers_complete). What only a refused request or one too large sets is not reset
        # there: either answer closes the connection.
        self.too_large = 0
        self.unread = False  # answered at its headers (refused, too large): the body is dropped
        self.refusal: str | None = None
        self._started = self.ended = False  # the answer's head, and all of it, written
        self.by_name: dict[bytes, bytes] = {}
        self.path = self.query = ""
        self.on_message_begin()
        self.in_message = self.in_head = False

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.server.full():
            self.server.refused_connections += 1
            self._refuse_now(503, f"too many connections (more than "
                                  f"{self.server.max_connections}); try again shortly")
            return
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if isinstance(peer, (tuple, list)) and peer else None
        self.server.connections.add(self)
        self.deadline.arm(self.server.keepalive_timeout_s)

    @property
    def answering(self) -> bool:
        """A request is being answered, by a task or from callbacks."""
        return self.task is not None or self.callbacks is not None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.deadline.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client left: the handler closes both legs
        callbacks, self.callbacks = self.callbacks, None
        if callbacks is not None:
            try:
                callbacks.client_gone()
            except Exception:  # noqa: BLE001 - the connection is gone either way
                log.exception("ending a request whose client left failed")
        waiter = self.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.task is not None or self.callbacks is not None or self.queue:  # (answering,
            # or a request ahead of this data): the next request waits its turn
            self.held.append(data)
            if self.transport is not None:
                self.transport.pause_reading()
            return
        self._consume(data)

    # -- reading ---------------------------------------------------------------------------
    def _consume(self, data: bytes) -> None:
        began = not self.in_message
        if began:  # between requests: this one's request line decides
            if self.undecided:
                data, self.undecided = self.undecided + data, b""
            if not HOT_REQUEST_LINE.match(data):
                if len(data) < DECIDE_BYTES and any(
                        line.startswith(data) for line in (b"POST /v1/completions",
                                                           b"POST /v1/chat/completions")):
                    self.undecided = data  # too short to tell yet
                    return
                self._hand_off(data)
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._refuse_now(400, f"malformed HTTP request: {exc}")
            return
        except httptools.HttpParserUpgrade:  # not an HttpParserError: it would escape
            self._refuse_now(400, "protocol upgrades (Upgrade, Connection: upgrade) are not "
                                  "supported")
            return
        if len(self.fields) > MAX_HEADERS:  # whatever the state (a request queued ahead, one
            # ended in this read): what the read added goes now, and its request is refused
            self.fields.clear()
            self.refusal = self.refusal or "431"
        if self.in_message and not self.queue:  # a request in progress (and none ahead of it
            # to answer first) is refused as soon as its head, or its framing and trailers, are
            # too long; a read that began in an earlier request is not counted (one read at most)
            if began:  # its read timeout runs from its first byte (a request read whole in
                self.deadline.arm(self.server.read_timeout_s)  # one read needs none)
            else:
                self.message_bytes += len(data)
            if self.refusal is None:
                if self.in_head:
                    if self.message_bytes > MAX_HEAD_BYTES:
                        self.refusal = "431"
                elif (self.message_bytes - self.body_bytes
                      > MAX_HEAD_BYTES + MAX_CHUNK_OVERHEAD * self.chunks):
                    self.refusal = "400 framing"
            if self.refusal is not None:
                self._refuse_now(*_REFUSALS[self.refusal])
                return
        self._next()

    def _hand_off(self, data: bytes) -> None:
        """The rest of this connection is aiohttp's (see the module's docstring)."""
        self.deadline.cancel()
        self.handed_off = True
        self.server.connections.discard(self)
        protocol = self.server.fallback()
        transport = self.transport
        assert transport is not None
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if data:
            protocol.data_received(data)
        transport.resume_reading()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.in_message = True
        self.in_head = True  # between the request's first byte and the end of its headers
        self.url = b""
        self.fields.clear()
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.message_bytes = 0  # bytes of reads begun while this request was in progress
        self.chunks = 0  # chunked bodies: chunks begun

    def on_url(self, url: bytes) -> None:
        if len(self.url) + len(url) > MAX_URL_BYTES:
            self.refusal = self.refusal or "414"  # answered once this read is parsed
            return
        self.url += url

    def on_headers_complete(self) -> None:
        """A request refused by its head (414, 431, not authorized: 401, too large: 413) is
        answered now, its body never read (nor asked for with 100 Continue)."""
        self.in_head = False
        fields = self.fields
        if len(fields) > MAX_HEADERS or (sum(map(len, fields)) + sum(map(len, fields.values()))
                                         > MAX_HEADER_BYTES):
            self.refusal = self.refusal or "431"
        if self.refusal is not None:
            self.unread = True
            self._complete()
            return
        by_name = self.by_name = header_map(fields)
        self.path, _, self.query = self.url.decode("latin-1").partition("?")
        if self.server.authorize is not None:
            authorization = by_name.get(b"authorization")
            refusal = self.server.authorize(self.path, authorization.decode(
                "utf-8", "surrogateescape") if authorization is not None else "")
            if refusal is not None:  # answered in its turn, and the connection closed
                self.unread = True
                self.queue.append(refusal)
                return
        declared = by_name.get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.server.max_body:
            self.too_large = int(declared)
            self.unread = True
            self._complete()
        elif b"expect" in by_name and by_name[b"expect"].lower() == b"100-continue":
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_chunk_header(self) -> None:
        self.chunks += 1
        if self.chunks > FREE_CHUNKS + self.body_bytes // MAX_CHUNK_OVERHEAD and not self.unread:
            self.refusal = self.refusal or "400 chunks"  # answered once this read is parsed

    def on_body(self, body: bytes) -> None:
        if self.unread:
            return
        self.body_bytes += len(body)
        if self.body_bytes > self.server.max_body:
            self.too_large = self.body_bytes
            self.unread = True
            self.body = []
            self._complete()
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        if not self.unread:
            if len(self.fields) > MAX_HEADERS:  # its trailers took it past the count
                self.refusal = self.refusal or "431"
            self._complete()
        self.in_message = False

    def _complete(self) -> None:
        """One request read (or refused): queue it for answering."""
        if self.refusal is not None:
            self.queue.append(self.refusal)
            return
        path, parser = self.path, self.parser
        if parser.get_method() != b"POST" or path not in HOT_PATHS:  # pipelined behind an
            self.queue.append("400 pipelined")                        # inference request
            return
        body = b"".join(self.body) if len(self.body) != 1 else self.body[0]
        self.queue.append(FastRequest(self, path, self.query, RequestHeaders(self.by_name),
                                      parser.get_http_version(), parser.should_keep_alive(), body,
                                      self.too_large))

    def _next(self) -> None:
        """Start answering the next queued request, or go back to reading."""
        if self.task is not None or self.callbacks is not None or self.closed:  # (answering)
            return
        if self.queue:
            item = self.queue.pop(0)
            self.deadline.disarm()
            if not isinstance(item, FastRequest):  # refused before the handler: answered, closed
                if isinstance(item, str):
                    self._refuse_now(*_REFUSALS[item])
                else:
                    self._refuse_with(item)
                return
            self.keep_alive = item.keep_alive and not item._too_large
            self.http11 = item.version == "1.1"
            self.ended = False
            try:
                answer = self.server.handler(item)  # (authorized at its headers)
            except Exception as exc:  # noqa: BLE001 - _answer logs it and answers 500
                answer = _raise(exc)
            if not isinstance(answer, CallbackAnswer):  # (one took the request itself)
                self.run(answer, item)
            return
        if self.held:  # what the client sent meanwhile: read at a request boundary
            held, self.held = b"".join(self.held), []
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()
            self._consume(held)
            return
        if not self.in_message:
            self.deadline.arm(self.server.keepalive_timeout_s)
        elif not self.deadline.armed:  # a request begun behind the one answered (whose answer
            self.deadline.arm(self.server.read_timeout_s)  # stopped the timer): its read timeout from now

    # -- answering -------------------------------------------------------------------------
    def run(self, answer: Awaitable[Any], request: FastRequest) -> asyncio.Task:
        """Answer the request in a task: `answer` gives the response (a CallbackAnswer hands the
        rest of its answer over this way when it must wait on something)."""
        self.callbacks = None
        self.task = self.loop.create_task(self._answer(request, answer))
        return self.task

    def answer_ended(self) -> None:
        """A CallbackAnswer has handed its answer's last byte to the socket: the connection
        reads on (or closes)."""
        self.callbacks = None
        if not self.keep_alive or self.server.closing:
            self.close()
            return
        self._next()

    def respond(self, response: web.Response, request: FastRequest) -> None:
        """A CallbackAnswer's whole answer, made: written now (a full socket drains in a task)."""
        try:
            self.write(self._whole(response))
        except ConnectionResetError:
            self.drop()
            return
        self.response_ended()
        if self.write_paused:
            self.run(self.drain(), request)  # (as _send: the socket's flow control)
        else:
            self.answer_ended()

    def drop(self) -> None:
        """A CallbackAnswer that cannot write its answer (the client is leaving): the connection
        closes, and the answer is over."""
        self.callbacks = None
        self.close()

    def answer_failed(self, request: FastRequest) -> None:
        """A CallbackAnswer failed on a bug: as _answer's handler that raised, a 500 if nothing
        of the answer was sent yet (the connection then closes), else the connection closes."""
        log.exception("error answering %s %s", request.method, request.path)
        self.keep_alive = False
        if self.ended or self._started:
            self.drop()
            return
        self.respond(web.Response(status=500, content_type="application/json",
                                  body=error_body(500, "internal server error")), request)

    async def _answer(self, request: FastRequest, answer: Awaitable[Any]) -> None:
        try:
            response = await answer
            if isinstance(response, FastStreamResponse):
                if not response._ended:  # a handler that returned mid-answer: end it cleanly
                    await response.write_eof()
            elif not self.ended and response is not None:
                await self._send(response)
        except asyncio.CancelledError:
            self.task = None
            self.close()
            return
        except (ConnectionResetError, TimeoutError):
            self.task = None
            self.close()
            return
        except Exception:  # noqa: BLE001 - as aiohttp: log it, answer 500, keep serving others
            log.exception("error answering %s %s", request.method, request.path)
            if not self.ended and not self._started:
                await self._send(web.Response(status=500, content_type="application/json",
                                              body=error_body(500, "internal server error")))
            self.keep_alive = False
        self.task = None
        if not self.keep_alive or self.server.closing:
            self.close()
            return
        self._next()

    async def _send(self, response: web.Response) -> None:
        self.write(self._whole(response))
        self.response_ended()
        await self.drain()

    def _whole(self, response: web.Response) -> bytes:
        """An aiohttp Response as the bytes of a whole answer."""
        body = response.body
        if body is None:
            body = b""
        elif not isinstance(body, (bytes, bytearray)):
            body = bytes(body._value)  # an aiohttp payload (json_response gives bytes)
        headers = {k: v for k, v in response.headers.items()
                   if k.lower() not in ("content-length", "transfer-encoding")}
        return self.head(response.status, headers, b"Content-Length: %d\r\n" % len(body)) + body

    # -- writing ---------------------------------------------------------------------------
    def head(self, status: int, headers: Any, framing: bytes | None) -> bytes:
        """The answer's status line and headers: `headers` a name -> value mapping, or its
        lines as bytes already (header_lines)."""
        self._started = True
        status_line = STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status
        if type(headers) is not bytes:
            headers = header_lines(headers)
        if not self.keep_alive or self.server.closing:
            connection = b"Connection: close\r\n"
        else:
            connection = b"" if self.http11 else b"Connection: keep-alive\r\n"
        return b"%b%b%b%b\r\n" % (status_line, headers, framing or b"", connection)

    def send_whole(self, status: int, headers: Any, body: bytes) -> bool:
        """A CallbackAnswer's whole answer of a known length, written now; True if the socket
        is full (run() a wait for it to drain before answer_ended())."""
        self.write(self.head(status, headers, b"Content-Length: %d\r\n" % len(body)) + body)
        self.response_ended()
        return self.write_paused

    def write(self, data: bytes) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("cannot write to a closing connection")
        self.transport.write(data)

    async def drain(self) -> None:
        if not self.write_paused:
            return
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        self.drain_waiter = self.loop.create_future()
        try:
            await self.drain_waiter
        finally:
            self.drain_waiter = None

    def response_ended(self) -> None:
        self.ended = True
        self._started = False

    def _refuse_now(self, status: int, message: str) -> None:
        """Answer a request that never reaches the handler, and close the connection."""
        body = error_body(status, message)
        self.keep_alive = False
        try:
            self.write(self.head(status, {"Content-Type": "application/json"},
                                 b"Content-Length: %d\r\n" % len(body)) + body)
        except ConnectionResetError:
            pass
        self.close()

    def _refuse_with(self, response: web.Response) -> None:
        """Send a refusal the hook gave (authorize) and close the connection."""
        self.keep_alive = False
        try:
            self.write(self._whole(response))
        except ConnectionResetError:
            pass
        self.close()

    def close(self) -> None:
        self.deadline.cancel()
        self.fields.clear()  # (the connection may outlive its close in a reference cycle)
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    # -- timers ----------------------------------------------------------------------------
    def _timed_out(self) -> None:
        if self.in_message:  # a request begun and not finished in time (slow loris)
            self._refuse_now(408, f"the request was not received within {self.server.read_timeout_s:g} s")
        elif not self.answering:  # idle keep-alive
            self.close()


async def _raise(exc: Exception) -> Any:
    raise exc


_REFUSALS = {
    "414": (414, f"request line longer than {MAX_URL_BYTES} bytes"),
    "431": (431, f"request headers larger than {MAX_HEADER_BYTES} bytes or more than {MAX_HEADERS}"),
    "400 framing": (400, f"chunked body framing and trailers larger than {MAX_HEAD_BYTES} bytes "
                         f"plus {MAX_CHUNK_OVERHEAD} per chunk"),
    "400 chunks": (400, f"chunked body in chunks averaging under {MAX_CHUNK_OVERHEAD} bytes"),
    "400 pipelined": (400, "a request pipelined behind an inference request must be one too "
                           "(POST /v1/completions or /v1/chat/completions); send it on its own"),
}
