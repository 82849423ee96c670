"""The router's HTTP/1.1 client for prefill and decode legs: asyncio.Protocol + httptools.

Why not aiohttp's client: it was measured (bench/, docs/benchmarks.md) to cost about half of a
PD request's router CPU time; this client does only what a proxy leg needs, with the same C parser
(llhttp, through httptools) that uvicorn uses. Background work (health checks, metric scrapes)
still uses aiohttp.

    pool = Upstream("127.0.0.1", 8001)
    resp = await pool.request("POST", "/v1/completions", body, {"X-Request-Id": rid}, timeout=30)
    data = await resp.read()                 # whole body (Content-Length, chunked or until EOF)
    async for chunk in resp: ...             # or: the body as it arrives
    await pool.close()

One Upstream per host:port keeps idle keep-alive connections (LIFO, up to `max_idle`). A
connection goes back to the pool only after its response was read to the end and the server
allowed keep-alive; a connection whose response was abandoned, cancelled or timed out is closed.
A timeout is one loop.call_later per request (no wait_for/tasks); it covers connect, headers and
body, and raises UpstreamTimeout. Connection problems raise UpstreamError (a ConnectionError).
A reused connection that the server closed before sending a single byte (the keep-alive race)
is retried once on a fresh connection, as browsers and aiohttp do.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable

import httptools

__all__ = ["Upstream", "Response", "UpstreamError", "UpstreamTimeout"]


# Unread body bytes per connection before the client stops reading from the socket.
MAX_BUFFERED = 1 << 20


class UpstreamError(ConnectionError):
    """The upstream connection failed, closed early, or sent a malformed response."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The request did not complete within its timeout."""


class _Stale(UpstreamError):
    """A reused connection was closed before any response byte: safe to retry once."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; carries one request/response at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reused = False
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.status, self.headers, self.chunks = 0, [], []
        self.buffered = 0  # bytes in chunks, not yet taken by the reader
        self.paused = False
        self.got_bytes = self.headers_done = self.done = False
        self.exc: BaseException | None = None
        self.waiter: asyncio.Future | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(UpstreamError(f"bad HTTP response: {exc}"))

    def eof_received(self) -> None:
        # httptools has no feed_eof: a body with neither Content-Length nor chunked framing
        # ends with the connection, so EOF completes it.
        if self.headers_done and not self.done and not any(
                k.lower() in (b"content-length", b"transfer-encoding") for k, _ in self.headers):
            self.closed = True
            self.on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.done:
            if not self.got_bytes and self.reused:
                self.fail(_Stale("keep-alive connection closed by the server"))
            else:
                self.fail(UpstreamError(f"connection closed mid-response: {exc or 'EOF'}"))

    # -- httptools callbacks ---------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > MAX_BUFFERED and not self.paused and self.transport is not None:
            # The reader is behind (a slow client downstream): let TCP push back on the server.
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.done = True
        if not self.parser.should_keep_alive():
            self.closed = True
        self._wake()

    # -- helpers ---------------------------------------------------------------------------
    def take(self) -> list[bytes]:
        """The body pieces that have arrived; reading resumes if it was paused."""
        chunks, self.chunks, self.buffered = self.chunks, [], 0
        if self.paused:
            self.paused = False
            if not self.closed and self.transport is not None:
                self.transport.resume_reading()
        return chunks

    def _wake(self) -> None:
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

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

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


def _no_data(conn: _Conn, timeout: float) -> None:
    conn.fail(UpstreamTimeout(f"no data within {timeout:g}s"))  # built only when it happens


class Response:
    """Status and headers of an upstream answer; the body via read() or `async for`."""

    __slots__ = ("status", "headers", "_conn", "_pool", "_timer", "_timer_at", "_due", "_timeout")


    def __init__(self, conn: _Conn, pool: Upstream, timer: asyncio.TimerHandle | None) -> None:
        self.status: int = conn.status
        self.headers: list[tuple[bytes, bytes]] = conn.headers  # raw (name, value) pairs
        self._conn, self._pool, self._timer = conn, pool, timer
        # rearm() (once per streamed chunk) only moves `_due`; the pending timer, due at
        # `_timer_at`, re-arms itself to `_due` when it fires early (one timer per request, not
        # one per chunk). `_due` None: disarmed.
        # The first timer (connect and headers, from _send) is not one of these: inf marks it,
        # so the first rearm or disarm cancels it.
        self._timer_at, self._due, self._timeout = float("inf"), None, 0.0

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        """The first value of a header, matched case-insensitively."""
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return default

    async def read(self) -> bytes:
        """The whole body; the connection then goes back to the pool."""
        conn = self._conn
        parts: list[bytes] = []
        while not conn.done:
            parts += conn.take()
            await conn.wait()
        parts += conn.take()
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
        chunks = conn.take()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def rearm(self, timeout: float) -> None:
        """Replace the request's timeout: from now on the rest must arrive within `timeout`."""
        loop = self._conn.loop
        due = loop.time() + timeout
        self._due, self._timeout = due, timeout
        if self._timer is not None and self._timer_at > due:  # the pending one is too late
            self._timer.cancel()
            self._timer = None
        if self._timer is None:
            self._timer_at = due
            self._timer = loop.call_at(due, self._expire)

    def _expire(self) -> None:
        self._timer = None
        conn, due = self._conn, self._due
        if conn is None or due is None:  # released, or disarmed meanwhile
            return
        if conn.loop.time() < due:  # rearmed meanwhile: wait for the new due time
            self._timer_at = due
            self._timer = conn.loop.call_at(due, self._expire)
            return
        _no_data(conn, self._timeout)

    def disarm(self) -> None:
        """Stop the timeout until the next rearm: time the caller spends elsewhere (writing to a
        slow client) is not the upstream's."""
        self._due = None
        if self._timer is not None and self._timer_at == float("inf"):
            self._timer.cancel()
            self._timer = None

    async def __aiter__(self):
        """The body in the pieces it arrives in (chunked framing already removed)."""
        conn = self._conn
        try:
            while True:
                if conn.chunks:
                    for c in conn.take():
                        yield c
                elif conn.done:
                    break
                else:
                    await conn.wait()
        finally:
            self.release()

    def release(self) -> None:
        """Return the connection if the response was read to the end, else close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        if conn.done and not conn.closed and conn.exc is None and not conn.paused:
            self._pool._put(conn)
        else:
            conn.abort()

    close = release

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


class Upstream:
    """A keep-alive pool of connections to one host:port."""

    def __init__(self, host: str, port: int, max_idle: int = 64,
                 connect_timeout: float = 5.0) -> None:
        self.host, self.port = host, port
        self.max_idle, self.connect_timeout = max_idle, connect_timeout
        self._idle: deque[_Conn] = deque()
        self._host_line = f"Host: {host}:{port}\r\n".encode()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(loop), self.host, self.port),
                self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {exc!r}") from exc
        return conn

    def _put(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle:
            conn.reused = True
            self._idle.append(conn)
        else:
            conn.abort()

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None,
                      timeout: float | None = None,
                      on_sent: Callable[[], None] | None = None) -> Response:
        """Send a request; return once the status and headers are in. `on_sent` is called once
        the request has been handed to a connection (the server may act on it from then on)."""
        head = [f"{method} {path} HTTP/1.1\r\n".encode(), self._host_line,
                b"Content-Length: %d\r\n" % len(body)]
        if headers:
            head += [f"{k}: {v}\r\n".encode() for k, v in headers.items()]
        head.append(b"\r\n")
        data = b"".join(head) + body
        for attempt in (0, 1):
            conn = None
            while self._idle:
                c = self._idle.pop()
                if not c.closed and not c.transport.is_closing():
                    conn = c
                    break
            if conn is None:
                conn = await self._connect()
            try:
                return await self._send(conn, data, timeout, on_sent)
            except _Stale:
                if attempt:
                    raise UpstreamError("upstream closed the connection twice") from None
        raise AssertionError("unreachable")

    async def _send(self, conn: _Conn, data: bytes, timeout: float | None,
                    on_sent: Callable[[], None] | None = None) -> Response:
        conn._reset()
        timer = None
        if timeout is not None:
            timer = conn.loop.call_later(timeout, self._timed_out, conn, timeout)
        try:
            conn.transport.write(data)
            if on_sent is not None:
                on_sent()
            while not conn.headers_done:
                await conn.wait()
        except BaseException:
            if timer is not None:
                timer.cancel()
            conn.abort()
            raise
        return Response(conn, self, timer)

    def _timed_out(self, conn: _Conn, timeout: float) -> None:
        conn.fail(UpstreamTimeout(f"{self.host}:{self.port} did not answer within {timeout:g}s"))

    async def close(self) -> None:
        """Close the idle connections."""
        while self._idle:
            self._idle.pop().abort()
