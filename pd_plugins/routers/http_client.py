"""The router's HTTP/1.1 client for prefill and decode legs: asyncio.Protocol + httptools.

Why not aiohttp's client: it was measured (bench/, docs/benchmarks.md) to cost about half of a
PD request's router CPU time; this client does only what a proxy leg needs, with the same C parser
(llhttp, through httptools) that uvicorn uses. Background work (health checks, metric scrapes)
still uses aiohttp.

    pool = Upstream("127.0.0.1", 8001)
    resp = await pool.request("POST", "/v1/completions", body, {"X-Request-Id": rid}, timeout=30)
    data = await resp.read()                 # whole body (Content-Length, chunked or until EOF)
    async for chunk in resp: ...             # or: the body as it arrives
    resp.pipe(sink, idle_s, until); await resp.piped()
                                             # or: each piece to sink(piece) in the connection's
                                             # callback, no task woken per piece (stream_relay.py)
    status, headers, body = await pool.exchange(pool.json_request(path, body, rid), timeout=30)
                                             # a whole answer, one wait (the legs that are not streamed)
    resp = await pool.open(pool.json_request(path, body, rid), timeout=30, first_body=True)
                                             # a prebuilt request; back at the body's first piece
    await pool.close()

One Upstream per host:port keeps idle keep-alive connections (LIFO, up to `max_idle`). A
connection goes back to the pool only after its response was read to the end and the server
allowed keep-alive; a connection whose response was abandoned, cancelled or timed out is closed.
A timeout is a `Deadline` per connection (deadline.py: re-armed per request without a new timer;
no wait_for/tasks); it covers connect, headers and body, and raises UpstreamTimeout. Connection
problems raise UpstreamError (a ConnectionError).
A reused connection that the server closed before sending a single byte (the keep-alive race)
is retried once on a fresh connection, as browsers and aiohttp do.

What a worker can make the router hold is bounded: a head past MAX_HEADERS headers or
MAX_HEAD_BYTES bytes, chunk framing and trailers past what the body's size explains, or an answer
that switches protocols (101) fail the connection (UpstreamError); an error answer's body is read
up to MAX_ERROR_BYTES (read() and exchange(), for any status but 200), then the
connection is dropped.

A request cancelled after its whole answer had arrived (the caller's task was cancelled in the
moment between the answer and its own resumption) still closes the connection, but hands the
answer to `on_orphan(status, body)` first, if given: the caller can then act on an answer it will
never read (pd-router releases the KV a prefill answer holds).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable, Sequence

import httptools
from mypy_extensions import mypyc_attr

from pd_plugins.routers.deadline import Deadline

__all__ = ["Upstream", "Leg", "Response", "UpstreamError", "UpstreamTimeout", "header_value"]

Orphan = Callable[[int, bytes], None]  # (status, whole body) of an answer its reader left


# Unread body bytes per connection before the client stops reading from the socket.
MAX_BUFFERED = 1 << 20
# A whole answer (exchange(): the legs that are not streamed) past this fails as the worker's
# fault: a generous bound (a 128k-token answer with top-20 logprobs is about 100 MB), so that no
# worker can make the router buffer without end.
MAX_ANSWER_BYTES = 256 << 20
# An error answer (any status but 200) is read up to this: the router needs its status and a
# short reason, never a body without end (read() would take it piece by piece, so MAX_BUFFERED
# never held it back).
MAX_ERROR_BYTES = 64 << 10
# A worker's head: status line and headers (httptools builds a header's value piece by piece in
# memory, so the bytes are counted as they arrive, not per header).
MAX_HEADERS = 128
MAX_HEAD_BYTES = 64 << 10
# A pooled connection idle this long is closed, not reused: uvicorn (vLLM's and SGLang's server)
# closes keep-alive connections after 5 s, and reusing one it is closing is the race below.
MAX_IDLE_S = 4.0
# A reused connection closed with no answer within this of the request's write is the keep-alive
# race (the server closed it as the request went out): the request is sent again, once. Closed
# later, the server may have received and begun it: a worker failure, never a second generation.
STALE_WINDOW_S = 0.25


def header_value(headers: list[tuple[bytes, bytes]], name: bytes,
                 default: bytes | None = None) -> bytes | None:
    """The first value of header `name` among raw (name, value) pairs, matched case-insensitively."""
    name = name.lower()
    for k, v in headers:
        if k.lower() == name:
            return v
    return default


def head_end(head: bytes, start: int) -> tuple[int, int]:
    """(where the head that begins at `start` ends, the length of its blank line)."""
    crlf = head.find(b"\r\n\r\n", start)
    # the first blank line (the body may hold others); LF alone is allowed, and looked for only
    # before the CRLF one, if there is one (not through the body)
    lf = head.find(b"\n\n", start) if crlf < 0 else head.find(b"\n\n", start, crlf + 1)
    if lf >= 0:
        return lf, 2
    return (crlf, 4) if crlf >= 0 else (len(head), 0)


def head_fields(head: bytes, start: int) -> list[tuple[bytes, bytes]]:
    """The (name, value) pairs of the head that begins at head[start] (its status line first),
    values without the whitespace around them, as llhttp hands them over."""
    fields: list[tuple[bytes, bytes]] = []
    for line in head[start:head_end(head, start)[0]].split(b"\n")[1:]:
        name, colon, value = line.partition(b":")
        if colon:
            fields.append((name, value.strip()))
    return fields


def head_field(head: bytes, start: int, name: bytes) -> bytes | None:
    """The first value of header `name` (lower case) in the head that begins at head[start],
    without parsing the rest: one search (a regex over the head cost more than the rest of a
    leg's parsing)."""
    end = head_end(head, start)[0]
    lowered = head[start:end].lower()
    at = lowered.find(b"\n%b:" % name)
    if at < 0:
        return None
    at += len(name) + 2
    stop = lowered.find(b"\n", at)
    return head[start + at:start + stop if stop >= 0 else end].strip()


# (native.py: mypyc compiles no class deriving from ConnectionError; these stay Python classes)
@mypyc_attr(native_class=False)
class UpstreamError(ConnectionError):
    """The upstream connection failed, closed early, or sent a malformed response."""


@mypyc_attr(native_class=False)
class UpstreamTimeout(UpstreamError, TimeoutError):
    """The request did not complete within its timeout (`timeout_s`: the one that ran out)."""

    def __init__(self, message: str, timeout_s: float) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s


@mypyc_attr(native_class=False)
class _Stale(UpstreamError):
    """A reused connection was closed before any response byte: safe to retry once."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; carries one request/response at a time."""

    # Slots: with more than 30 attributes, CPython 3.11 gives an instance a dict of its own, and
    # then neither its attribute reads nor its method calls specialize (docs/benchmarks.md).
    __slots__ = ("loop", "peer", "transport", "parser", "idle", "reused", "idle_since", "sent_at",
                 "closed", "deadline", "timeout_s", "answered", "whole", "first_body",
                 "body_timeout", "sink", "idle_s", "until", "notify", "in_read", "notify_due",
                 "paused", "interim", "exc", "waiter", "status", "chunks", "head", "head_start",
                 "_headers", "buffered", "received", "body_bytes", "limit", "got_bytes",
                 "headers_done", "done")

    def __init__(self, loop: asyncio.AbstractEventLoop, peer: str = "") -> None:
        self.loop, self.peer = loop, peer  # peer: host:port, for the timeout's message
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reused = False
        self.idle = False  # in the pool: nothing may arrive now
        self.idle_since = self.sent_at = 0.0
        self.closed = False
        self.deadline = Deadline(loop, self._timed_out)
        self.timeout_s, self.answered = 0.0, False  # the timeout armed, and for which part
        self.whole = False  # exchange(): wake the reader only once the answer is complete
        # open(first_body=True): a 200 answer's reader is woken at its first piece of body, not
        # at its head as well (a streamed leg: one wake-up of the request's task fewer)
        self.first_body = False
        self.body_timeout: float | None = None  # exchange(): the body's, from the headers on
        # Response.pipe(): each body piece goes to sink(piece) in this callback, the reader's task
        # is not woken for it; a sink that returns True pauses reading (Response.resume). Each
        # read re-arms the timeout: the next within idle_s, and none after `until` (loop time).
        self.sink: Callable[[bytes], bool] | None = None
        self.idle_s = self.until = 0.0
        # Leg and Response.notify: progress is reported by calling this where a waiting reader
        # would be woken (after the read that made it, never inside the parser's callbacks)
        self.notify: Callable[[], None] | None = None
        self.in_read = self.notify_due = False
        # what an answer leaves as it found it, or only on a connection never reused (a failed
        # one is closed; a reused one was read to its end, resumed, its reader's hooks dropped)
        self.paused = self.interim = False
        self.exc: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.chunks: list[bytes] = []
        self._headers: list[tuple[bytes, bytes]] | None = None
        self.start(None, None, False, False)

    def start(self, timeout: float | None, body_timeout: float | None, whole: bool,
              first_body: bool) -> None:
        """Ready for a request's answer (see __init__ for what needs no reset), its timeout
        armed (None: none). Called on every leg: it does what helpers did in several calls."""
        self.status, self.chunks = 0, []
        # the answer's head as it came (its reads until the head ended, interim answers first):
        # headers are parsed from it only when asked for (`headers`), not one callback each
        self.head, self.head_start, self._headers = b"", 0, None
        self.buffered = 0  # bytes in chunks, not yet taken by the reader
        # every byte of this answer received, and of its body: the rest (head, chunk framing,
        # trailers) is bounded (data_received)
        self.received = self.body_bytes = 0
        self.limit = MAX_ANSWER_BYTES  # exchange(): what the answer's body may reach
        self.got_bytes = self.headers_done = self.done = False
        self.whole, self.body_timeout, self.first_body = whole, body_timeout, first_body
        if timeout is not None:
            self.arm(timeout, answered=False)
        else:
            self.deadline.disarm()
        self.sent_at = self.loop.time()

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.idle:  # bytes nobody asked for would prefix the next answer: drop the connection
            self.abort()
            return
        self.in_read = self.got_bytes = True
        self.received += len(data)
        try:
            if not self.headers_done:
                self.head += data  # (bounded below with the head: MAX_HEAD_BYTES)
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError as exc:
                if self.sink is not None and self.chunks:  # the body before the error goes on
                    self._feed_sink()
                cause = exc.__context__  # what a callback raised (past a limit)
                self.fail(cause if isinstance(cause, UpstreamError) else
                          UpstreamError(f"bad HTTP response: {exc}"))
            except httptools.HttpParserUpgrade:
                self.fail(UpstreamError("the worker switched protocols (HTTP 101)"))
            else:
                # all but the body: the head until it ends, then chunk framing and trailers,
                # which a body of real pieces keeps well under half its size
                if not self.headers_done and self.head.count(b"\n", self.head_start) > MAX_HEADERS + 1:
                    self.fail(UpstreamError(f"answer with more than {MAX_HEADERS} headers"))
                elif self.received - self.body_bytes > MAX_HEAD_BYTES + (self.body_bytes >> 1) \
                        and self.exc is None:
                    self.fail(UpstreamError(f"answer's head, chunk framing or trailers larger than "
                                            f"{MAX_HEAD_BYTES} bytes" if not self.headers_done else
                                            "answer's chunk framing or trailers out of proportion "
                                            "to its body"))
                elif self.sink is not None and self.chunks:
                    self._feed_sink()
        finally:
            self.in_read = False
        if self.notify_due:  # last: the callee may reuse this connection for its next request
            self.notify_due = False
            if self.notify is not None:
                self.notify()

    def eof_received(self) -> None:
        # httptools has no feed_eof: a body with neither Content-Length nor chunked framing
        # ends with the connection, so EOF completes it.
        if self.headers_done and not self.done and not any(
                k.lower() in (b"content-length", b"transfer-encoding") for k, _ in self.headers):
            self.closed = True
            self.on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.deadline.cancel()  # an idle pooled connection too: nothing will arm it again
        if not self.done:
            if (not self.got_bytes and self.reused
                    and self.loop.time() - self.sent_at < STALE_WINDOW_S):
                self.fail(_Stale("keep-alive connection closed by the server"))
            else:
                self.fail(UpstreamError(f"connection closed mid-response: {exc or 'EOF'}"))

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """The answer's raw (name, value) pairs, parsed from its head on first use."""
        headers = self._headers
        if headers is None:
            headers = self._headers = head_fields(self.head, self.head_start)
        return headers

    # -- httptools callbacks (no on_header: see `headers`) -----------------------------------
    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            end, blank = head_end(self.head, self.head_start)
            self.head_start, self.interim = end + blank, True
            return
        if self.done:  # a second answer where one was asked for: it must not reach the next
            raise UpstreamError("bytes past the end of the answer")  # (fail() closes it)
        head, start = self.head, self.head_start
        # the head's lines (the status line's counted, the last header's is the blank line's),
        # not the body's: a byte-at-a-time count of a long answer's newlines cost microseconds
        if head.count(b"\n", start, head_end(head, start)[0]) > MAX_HEADERS:
            raise UpstreamError(f"answer with more than {MAX_HEADERS} headers")
        self.status = status
        self.headers_done = True
        if status == 200:
            if self.whole:  # the body's own timeout, for an answer that is one
                if self.body_timeout is not None:
                    self.arm(self.body_timeout, answered=True)
            elif not self.first_body:
                self._wake()
            return
        # an error answer: its reason comes under what is left of the first timeout, bounded
        self.limit = MAX_ERROR_BYTES
        if not self.whole:
            self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        self.body_bytes += len(body)
        if self.sink is not None:  # piped: what this read brought goes to it at the read's end
            return
        if self.whole:  # its reader takes the whole answer: nothing to pace, but bounded
            if self.buffered > self.limit and self.exc is None:
                self.fail(UpstreamError(f"answer larger than {self.limit} bytes"))
            return
        if self.buffered > MAX_BUFFERED and not self.paused and self.transport is not None:
            # The reader is behind (a slow client downstream): let TCP push back on the server.
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def _feed_sink(self) -> None:
        """What the body brought since the last call, to the sink (Response.pipe) in one piece
        (a read with several of the server's chunks: one write on, not one per chunk)."""
        chunks, self.chunks, self.buffered = self.chunks, [], 0
        assert self.sink is not None  # (_feed_sink runs only for a piped answer)
        if self.sink(chunks[0] if len(chunks) == 1 else b"".join(chunks)):
            if not self.paused:
                self.paused = True
                self.deadline.disarm()  # the reader's time with the sink is not the server's
                if self.transport is not None:
                    self.transport.pause_reading()
                self._wake()
        elif not (self.done or self.paused):  # (the end disarmed it: on_message_complete)
            self.deadline.arm(min(self.idle_s, self.until - self.loop.time()))

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.done = True
        if not self.parser.should_keep_alive():
            self.closed = True
        if self.sink is not None:  # piped: its reader finishes the answer without a timeout
            self.deadline.disarm()
        self._wake()

    # -- helpers ---------------------------------------------------------------------------
    def orphan(self, on_orphan: Orphan | None, read: Sequence[bytes] = ()) -> None:
        """The reader was cancelled: hand over the answer if all of it had arrived (`read`: the
        pieces the reader had taken already)."""
        if on_orphan is not None and self.done and self.exc is None:
            on_orphan(self.status, b"".join([*read, *self.take()]))

    def take(self) -> list[bytes]:
        """The body pieces that have arrived; reading resumes if it was paused."""
        chunks, self.chunks, self.buffered = self.chunks, [], 0
        if self.paused:
            self.paused = False
            if not self.closed and self.transport is not None:
                self.transport.resume_reading()
        return chunks

    def _wake(self) -> None:
        if self.notify is not None:
            if self.in_read:
                self.notify_due = True
            else:
                self.notify()
            return
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """Record the error, wake the reader, and drop the connection."""
        if self.exc is None:
            self.exc = exc
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(exc)
        self.abort()
        if self.notify is not None:
            self._wake()

    def ready(self) -> bool:
        """The answer is in as far as its reader asked: whole (`whole`), or its status and
        headers and, for a 200 answer read from `first_body`, its first piece of body or its end."""
        if self.whole:
            return self.done
        return self.headers_done and (not self.first_body or self.status != 200
                                      or bool(self.chunks) or self.done)

    def abort(self) -> None:
        self.closed = True
        self.deadline.cancel()
        if self.transport is not None:
            self.transport.abort()

    def arm(self, timeout: float, answered: bool) -> None:
        """The rest of this request must arrive within `timeout` (`answered`: its status and
        headers are in, and the timeout is for the body)."""
        self.timeout_s, self.answered = timeout, answered
        self.deadline.arm(timeout)

    def _timed_out(self) -> None:
        if self.answered:
            self.fail(UpstreamTimeout(f"no data within {self.timeout_s:g}s", self.timeout_s))
        else:
            self.fail(UpstreamTimeout(f"{self.peer} did not answer within {self.timeout_s:g}s",
                                      self.timeout_s))

    async def wait(self) -> None:
        """Sleep until the parser makes progress; close the connection if cancelled."""
        if self.exc is not None:
            raise self.exc
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        except asyncio.CancelledError:
            self.abort()
            raise
        finally:
            self.waiter = None


class Response:
    """Status and headers of an upstream answer; the body via read() or `async for`."""

    __slots__ = ("status", "_head", "_headers", "_conn", "_pool", "_on_orphan")

    def __init__(self, conn: _Conn, pool: Upstream, on_orphan: Orphan | None = None) -> None:
        self.status: int = conn.status
        # the head's bytes (the connection's are the next answer's once it is reused)
        self._head, self._headers = (conn.head, conn.head_start), conn._headers
        self._conn: _Conn | None = conn  # (None once released)
        self._pool, self._on_orphan = pool, on_orphan

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """Raw (name, value) pairs, parsed from the head on first use."""
        headers = self._headers
        if headers is None:
            headers = self._headers = head_fields(*self._head)
        return headers

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        """The first value of a header, matched case-insensitively."""
        value = head_field(*self._head, name.lower())
        return default if value is None else value

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; the connection then goes back to the pool. A body past `limit` bytes
        (default: MAX_ANSWER_BYTES for a 200 answer, MAX_ERROR_BYTES for any other, as exchange()
        bounds them) raises UpstreamError and drops the connection."""
        conn = self._conn
        parts: list[bytes] = []
        size = 0
        if limit is None:
            limit = MAX_ANSWER_BYTES if self.status == 200 else MAX_ERROR_BYTES
        try:
            while True:
                size += conn.buffered
                if size > limit:
                    conn.fail(UpstreamError(f"answer larger than {limit} bytes"))
                    assert conn.exc is not None  # (that one, or what failed it before)
                    raise conn.exc
                parts += conn.take()
                if conn.done:
                    break
                await conn.wait()
        except asyncio.CancelledError:
            conn.orphan(self._on_orphan, parts)
            raise
        body = b"".join(parts) if len(parts) != 1 else parts[0]
        self.release()
        return body

    async def next_chunk(self) -> bytes:
        """Everything of the body that has arrived (waiting for some); b"" at its end."""
        conn = self._conn
        while not conn.chunks:
            if conn.done:
                return b""
            await conn.wait()
        return self.arrived()

    def arrived(self) -> bytes:
        """Everything of the body that has arrived, now (b"" if nothing has)."""
        chunks = self._conn.take()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def pipe(self, sink: Callable[[bytes], bool], idle_s: float, until: float) -> None:
        """From now on hand each piece of the body to `sink` as it arrives, in the connection's
        callback: a stream relayed piece by piece wakes no task per piece. The pieces that
        arrived already go first, now. `sink` must not raise; it returns True to pause reading
        (TCP then pushes back on the server, and the timeout stops) until resume(). Each piece
        must come within `idle_s` of the one before, and none after `until` (time.monotonic());
        past either, UpstreamTimeout. Wait for the end with piped()."""
        conn = self._conn
        conn.sink, conn.idle_s = sink, idle_s
        self.resume(until)
        if conn.chunks:
            conn._feed_sink()

    async def piped(self) -> None:
        """Wait until the piped body ends (done), the sink paused reading (paused), or the
        answer fails (its UpstreamError or UpstreamTimeout is raised)."""
        conn = self._conn
        while not (conn.done or conn.paused):
            await conn.wait()
        if conn.chunks:  # what came with an error after the end (bytes past it, a timer)
            conn._feed_sink()
        if conn.exc is not None and not conn.done:  # a whole answer is one, whatever came after
            raise conn.exc

    def notify(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` (in the connection's callback) where piped() would wake, instead of
        waking a waiter: the piped body ended, the sink paused, or the answer failed."""
        self._conn.notify = callback

    @property
    def exception(self) -> BaseException | None:
        """What failed the answer, if it failed before its end."""
        conn = self._conn
        return conn.exc if conn.exc is not None and not conn.done else None

    @property
    def paused(self) -> bool:
        """The sink paused reading (pipe): resume() reads on."""
        return self._conn.paused

    @property
    def done(self) -> bool:
        """The whole answer has arrived."""
        return self._conn.done

    def resume(self, until: float) -> None:
        """Read the piped body again after the sink paused; `until` as in pipe()."""
        conn, left = self._conn, until - time.monotonic()
        conn.until = conn.loop.time() + left  # the connection's timeout runs on the loop's clock
        if conn.done:
            conn.deadline.disarm()
        else:
            conn.arm(min(conn.idle_s, left), answered=True)
        if conn.paused:
            conn.paused = False
            if not conn.closed and conn.transport is not None:
                conn.transport.resume_reading()

    def rearm(self, timeout: float) -> None:
        """Replace the request's timeout: from now on the rest must arrive within `timeout`
        (cheap enough for every chunk: it moves a due time, see deadline.py)."""
        if self._conn is not None:
            self._conn.arm(timeout, answered=True)

    def disarm(self) -> None:
        """Stop the timeout until the next rearm: time the caller spends elsewhere (writing to a
        slow client) is not the upstream's."""
        if self._conn is not None:
            self._conn.deadline.disarm()

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        """`async for`: the body in the pieces it arrives in (chunked framing already removed;
        several read at once come as one), the connection released at its end. (Not an async
        generator: mypyc compiles none, native.py. One left early is released by `async with`.)"""
        try:
            piece = await self.next_chunk()
        except BaseException:
            self.release()
            raise
        if not piece:
            self.release()
            raise StopAsyncIteration
        return piece

    def release(self) -> None:
        """Return the connection if the response was read to the end, else close it."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._release(conn)

    def close(self) -> None:
        """release(), by the name aiohttp's responses have."""
        self.release()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


class Leg:
    """A request sent from a callback: `on_answer(leg)` is called, in the connection's callback,
    once its answer is in as exchange() or open() would return it (`conn`), or it failed
    (`error`: an UpstreamError). No task and no future: pd-router's request path serves its legs
    this way (exchange.py). Only opening a new connection runs as a task. The keep-alive race is
    retried once on a fresh connection, as _sent() does; cancel() closes the leg."""

    # (no __slots__: what most legs never change stays a class default, not set per leg)
    conn: _Conn | None = None
    connecting: asyncio.Task | None = None
    error: BaseException | None = None
    retried = False
    sent = False  # the request is on its way: the worker may act on it
    cancelled = False

    def __init__(self, pool: Upstream, data: bytes, timeout: float,
                 on_answer: Callable[[Leg], None], body_timeout: float | None, whole: bool,
                 first_body: bool) -> None:
        self.pool, self.data, self.timeout, self.on_answer = pool, data, timeout, on_answer
        self.body_timeout, self.whole, self.first_body = body_timeout, whole, first_body

    def connect(self) -> None:
        self.connecting = asyncio.ensure_future(self.pool._connect())
        self.connecting.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task) -> None:
        self.connecting = None
        if task.cancelled():  # cancel(): nobody waits for this leg
            return
        error = task.exception()
        if self.cancelled:  # cancelled as the connection opened: kept for another leg
            if error is None:
                self.pool._put(task.result())
            return
        if error is not None:
            self.error = error
            self.on_answer(self)
        else:
            self.send(task.result())

    def send(self, conn: _Conn) -> None:
        self.conn = conn
        conn.start(self.timeout, self.body_timeout, self.whole, self.first_body)
        conn.notify = self._progress
        conn.transport.write(self.data)
        self.sent = True

    def _progress(self) -> None:
        conn = self.conn
        error = conn.exc
        if conn.ready():
            # in as far as asked for: an answer, whatever failed after it (as _sent() returns it)
            if conn.status != 200 and not conn.done:
                if error is None:  # an error answer: its reason comes whole (MAX_ERROR_BYTES)
                    conn.whole = True
                    return
                conn.chunks = []  # its body failed: its status says which
            error = None
        elif error is None:
            return
        elif isinstance(error, _Stale):
            conn.notify = None
            conn.abort()
            if not self.retried:
                self.retried, self.sent, self.conn = True, False, None
                self.connect()
                return
            error = UpstreamError("upstream closed the connection twice")
        elif conn.headers_done and conn.status != 200:  # an error answer whose body failed
            conn.chunks, error = [], None
        conn.notify = None  # this leg's answer is its caller's from now on
        self.error = error
        self.on_answer(self)

    def body(self) -> bytes:
        """The answer's body as it is in (whole: all of it); the connection goes back to its
        pool (or is closed, if its answer is not complete)."""
        conn, self.conn = self.conn, None
        assert conn is not None  # (answered: on_answer's caller reads it once)
        chunks = conn.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.pool._release(conn)
        return body

    def response(self) -> Response:
        """The answer opened (first_body), to be read on: the caller releases it."""
        conn, self.conn = self.conn, None
        assert conn is not None
        return Response(conn, self.pool)

    def cancel(self) -> None:
        """Nobody wants this leg any more: close its connection (the worker aborts it)."""
        self.cancelled = True
        if self.connecting is not None:
            self.connecting.cancel()
            self.connecting = None
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.notify = None
            self.pool._release(conn)


class Upstream:
    """A keep-alive pool of connections to one host:port."""

    def __init__(self, host: str, port: int, max_idle: int = 64,
                 connect_timeout: float = 5.0) -> None:
        self.host, self.port = host, port
        self.max_idle, self.connect_timeout = max_idle, connect_timeout
        self._idle: deque[_Conn] = deque()
        self.closed = False  # close(): connections in use are closed when they come back
        self._peer = f"{host}:{port}"
        self._host_line = f"Host: {self._peer}\r\n".encode()
        # a JSON POST's request head, filled in with path, body length and request id
        self._json_head = (b"POST %b HTTP/1.1\r\n" + self._host_line.replace(b"%", b"%%")
                           + b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                             b"X-Request-Id: %b\r\n\r\n")

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(loop, self._peer), self.host, self.port),
                self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {exc!r}") from exc
        return conn

    def _release(self, conn: _Conn) -> None:
        """Back to the pool if its answer was read to the end and it may be reused; else closed."""
        conn.deadline.disarm()
        # (the reader's sink and callback, and what they reference, are not held until reused)
        conn.sink = conn.notify = None
        if conn.done and not (conn.closed or conn.paused) and conn.exc is None:
            self._put(conn)
        else:
            conn.abort()

    def _put(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle and not self.closed:
            conn.reused = conn.idle = True
            conn.idle_since = conn.loop.time()
            self._idle.append(conn)
        else:
            conn.abort()

    def _idle_conn(self) -> _Conn | None:
        while self._idle:
            c = self._idle.pop()  # the newest: if it idled too long, so did every other
            if c.closed or c.transport.is_closing():
                continue
            if c.loop.time() - c.idle_since > MAX_IDLE_S:
                c.abort()
                continue
            c.idle = False
            return c
        return None

    def json_request(self, path: str, body: bytes, request_id: str) -> bytes:
        """The bytes of a JSON POST with an X-Request-Id (request id: printable ASCII)."""
        return self._json_head % (path.encode(), len(body), request_id.encode()) + body

    async def exchange(self, data: bytes, timeout: float, body_timeout: float | None = None,
                       on_sent: Callable[[], None] | None = None,
                       on_orphan: Orphan | None = None) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Send a whole request (`data`, e.g. from json_request) and return the whole answer:
        (status, raw headers, body). One wait per answer: the reader is woken when the answer is
        complete, not per piece. `timeout` runs until the headers are in, `body_timeout` (default:
        the same, not renewed) from then on for a 200 answer; the body of any other answer comes
        under `timeout`, and one that fails is returned empty (as request() + read() callers
        treated it: the status decides). on_sent and on_orphan as in request()."""
        conn = await self._sent(data, timeout, on_sent, on_orphan, body_timeout=body_timeout,
                                whole=True)
        chunks = conn.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._release(conn)
        return conn.status, conn.headers, body

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None,
                      timeout: float | None = None,
                      on_sent: Callable[[], None] | None = None,
                      on_orphan: Orphan | None = None) -> Response:
        """Send a request; return once the status and headers are in. `on_sent` is called once
        the request has been handed to a connection (the server may act on it from then on);
        `on_orphan`: see the module's docstring."""
        head = [f"{method} {path} HTTP/1.1\r\n".encode(), self._host_line,
                b"Content-Length: %d\r\n" % len(body)]
        if headers:
            head += [f"{k}: {v}\r\n".encode() for k, v in headers.items()]
        head.append(b"\r\n")
        return await self.open(b"".join(head) + body, timeout, on_sent, on_orphan)

    async def open(self, data: bytes, timeout: float | None = None,
                   on_sent: Callable[[], None] | None = None, on_orphan: Orphan | None = None,
                   first_body: bool = False) -> Response:
        """Send a whole request (`data`, e.g. from json_request); return once the status and
        headers are in (`first_body`: for a 200 answer, once the first piece of its body is in
        too, or its end) as request() does."""
        conn = await self._sent(data, timeout, on_sent, on_orphan, first_body=first_body)
        return Response(conn, self, on_orphan)

    def leg(self, data: bytes, timeout: float, on_answer: Callable[[Leg], None], *,
            body_timeout: float | None = None, whole: bool = False,
            first_body: bool = False) -> Leg:
        """Send a whole request (`data`) now, from a callback: exchange()'s or open()'s, with no
        task and no wait (see Leg)."""
        leg = Leg(self, data, timeout, on_answer, body_timeout, whole, first_body)
        conn = self._idle_conn()
        if conn is None:
            leg.connect()
        else:
            leg.send(conn)
        return leg

    async def _sent(self, data: bytes, timeout: float | None,
                    on_sent: Callable[[], None] | None, on_orphan: Orphan | None,
                    body_timeout: float | None = None, whole: bool = False,
                    first_body: bool = False) -> _Conn:
        """A connection that `data` went out on and whose answer's headers (`whole`: all of the
        answer) are in. A reused connection that the server had closed is replaced once."""
        for attempt in (0, 1):
            conn = self._idle_conn() or await self._connect()
            conn.start(timeout, body_timeout, whole, first_body)
            try:
                conn.transport.write(data)
                if on_sent is not None:
                    on_sent()
                while not conn.ready():
                    await conn.wait()
                return conn
            except _Stale:
                conn.abort()
                if attempt:
                    raise UpstreamError("upstream closed the connection twice") from None
            except BaseException as exc:
                conn.abort()
                if isinstance(exc, asyncio.CancelledError):
                    conn.orphan(on_orphan)
                elif (conn.whole and conn.headers_done and conn.status != 200
                      and isinstance(exc, UpstreamError)):
                    conn.chunks = []  # an error answer whose body failed: its status still says which
                    return conn
                raise
        raise AssertionError("unreachable")

    def shut(self) -> None:
        """Close the idle connections now, and each one in use when its answer is done."""
        self.closed = True
        while self._idle:
            self._idle.pop().abort()

    async def close(self) -> None:
        self.shut()
