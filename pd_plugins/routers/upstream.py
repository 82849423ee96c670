"""HTTP legs to the workers, and how their failures are classified.

A leg either succeeds, fails because of the worker (connection refused or reset, timeout, 5xx, 429,
a malformed answer): `WorkerFailed`, which the proxy may retry elsewhere; or the worker refuses the
request itself (4xx): `RequestRefused`, which is passed to the client as it is, because another
worker would refuse it too. Legs go through `http_client` (one keep-alive pool per worker).
"""

from __future__ import annotations

import re
from typing import Any, Callable, NoReturn
from urllib.parse import urlsplit

import aiohttp
import msgspec

from pd_plugins.routers.http_client import (MAX_ERROR_BYTES, Leg, Orphan, Response, Upstream,
                                            UpstreamError, UpstreamTimeout, header_value)
from pd_plugins.routers.request import LegBody, leg_json


class WorkerFailed(Exception):
    def __init__(self, worker: Any, leg: str, message: str) -> None:
        super().__init__(f"{leg} on {worker.url}: {message}")
        self.worker, self.leg, self.message = worker, leg, message


class RequestRefused(Exception):
    def __init__(self, status: int, body: bytes, content_type: str | None) -> None:
        super().__init__(f"worker refused the request with {status}")
        self.status, self.body, self.content_type = status, body, content_type


def new_session(connect_timeout_s: float) -> aiohttp.ClientSession:
    """For background requests (health checks, metric scrapes), not for legs."""
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s))


class Pools:
    """One keep-alive connection pool per worker URL."""

    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._pools: dict[str, Upstream] = {}

    def get(self, url: str) -> Upstream:
        pool = self._pools.get(url)
        if pool is None:
            pool = self._pools[url] = self._new(url)
        return pool

    def of(self, worker: Any) -> Upstream:
        """The pool of a worker's legs. A removed worker's request in flight (its decode leg
        after its prefill, a retry) gets a pool nobody keeps, shut: each connection is closed
        after its answer, and no table grows with workers that came and went."""
        pool = self._pools.get(worker.url)  # (nearly every leg: one lookup)
        if pool is not None:
            return pool
        if worker.removed:
            pool = self._new(worker.url)
            pool.shut()
            return pool
        return self.get(worker.url)

    def _new(self, url: str) -> Upstream:
        parts = urlsplit(url)
        return Upstream(parts.hostname or "127.0.0.1", parts.port or 80,
                        connect_timeout=self.connect_timeout_s)

    def forget(self, url: str) -> None:
        """A removed worker's pool: shut (its requests in flight finish) and dropped, so that
        workers that come and go (discovery) do not pile up pools and their sockets."""
        pool = self._pools.pop(url, None)
        if pool is not None:
            pool.shut()

    async def close(self) -> None:
        for pool in self._pools.values():
            await pool.close()


def _failure(worker: Any, leg: str, exc: BaseException) -> WorkerFailed:
    if isinstance(exc, UpstreamTimeout):  # the timeout that ran out: first byte, or the body's
        return WorkerFailed(worker, leg, f"no response within {exc.timeout_s:g} s")
    return WorkerFailed(worker, leg, str(exc))


async def open_leg(pools: Pools, worker: Any, leg: str, path: str, body: LegBody,
                   request_id: str, timeout_s: float,
                   on_sent: Callable[[], None] | None = None,
                   on_orphan: Orphan | None = None) -> Response:
    """POST and wait for the response headers and, for a 200 answer, the first piece of its
    body (or its end); non-2xx answers are classified and raised.

    The timeout keeps running over the body until the caller re-arms it (Response.pipe, rearm).
    `on_sent`: called once the request is on its way to the worker; `on_orphan`: given the
    whole answer if the caller is cancelled after it arrived (http_client.py)."""
    upstream = pools.of(worker)
    try:
        resp = await upstream.open(upstream.json_request(path, leg_json(body), request_id),
                                   timeout_s, on_sent, on_orphan, first_body=True)
    except UpstreamError as exc:
        raise _failure(worker, leg, exc) from None
    if resp.status == 200:
        return resp
    try:  # its status decides; a body past the bound is dropped with the connection
        payload = await resp.read(MAX_ERROR_BYTES)
    except UpstreamError:
        payload = b""
    finally:
        resp.release()
    _refused_or_failed(worker, leg, resp.status, payload, resp.header(b"content-type"))


async def whole_leg(pools: Pools, worker: Any, leg: str, path: str, body: LegBody,
                    request_id: str, timeout_s: float, body_timeout_s: float | None = None,
                    on_sent: Callable[[], None] | None = None,
                    on_orphan: Orphan | None = None) -> bytes:
    """A whole non-streaming leg's 200 answer (the status and headers within `timeout_s`, the
    body within `body_timeout_s` from then, default the same); other answers are classified and
    raised as open_leg's are."""
    upstream = pools.of(worker)
    try:
        status, headers, payload = await upstream.exchange(
            upstream.json_request(path, leg_json(body), request_id), timeout_s, body_timeout_s,
            on_sent, on_orphan)
    except UpstreamError as exc:
        raise _failure(worker, leg, exc) from None
    if status == 200:
        return payload
    _refused_or_failed(worker, leg, status, payload, header_value(headers, b"content-type"))


def send_leg(pools: Pools, worker: Any, path: str, body: LegBody, request_id: str,
             timeout_s: float, on_answer: Callable[[Leg], None], opened: bool = False) -> Leg:
    """whole_leg (or open_leg, `opened`) from a callback: the leg goes out now, and
    `on_answer(leg)` is called in its connection's callback once the answer is in; read it with
    leg_answer (or opened_answer). The timeout as whole_leg's (open_leg's)."""
    upstream = pools.of(worker)
    return upstream.leg(upstream.json_request(path, leg_json(body), request_id), timeout_s,
                        on_answer, whole=not opened, first_body=opened)


def leg_answer(leg: Leg, worker: Any, name: str) -> bytes:
    """A sent leg's whole 200 answer; other answers classified and raised as whole_leg's."""
    if leg.error is not None:
        raise _failure(worker, name, leg.error)
    conn = leg.conn
    status = conn.status
    payload = leg.body()
    if status == 200:
        return payload
    _refused_or_failed(worker, name, status, payload, header_value(conn.headers, b"content-type"))


def opened_answer(leg: Leg, worker: Any, name: str) -> Response:
    """A sent leg's 200 answer opened at its first piece of body, as open_leg returns it; other
    answers (read whole) classified and raised as open_leg's."""
    if leg.error is not None:
        raise _failure(worker, name, leg.error)
    if leg.conn.status == 200:
        return leg.response()
    leg_answer(leg, worker, name)
    raise AssertionError("unreachable")  # (leg_answer raised: the status is not 200)


def stream_begun(resp: Response, worker: Any) -> bytes:
    """The first piece of a decode's event stream opened at its first piece of body (open_leg,
    opened_answer); WorkerFailed, the leg released, if it is not one."""
    chunk = resp.arrived()
    if not chunk:
        resp.release()
        raise WorkerFailed(worker, "decode", "stream ended before any data")
    content_type = (resp.header(b"content-type") or b"").lower()
    if not content_type.startswith(b"text/event-stream"):  # relayed, it would look complete
        resp.release()
        raise WorkerFailed(worker, "decode", f"answer is not an event stream "
                                             f"({content_type[:60]!r}): {chunk[:80]!r}")
    return chunk


_json_object = re.compile(rb"\s*\{").match  # (as lstrip().startswith(b"{"), with no copy)


def json_answer(payload: bytes, worker: Any) -> bytes:
    """A whole decode answer that is a JSON object (by its first byte); WorkerFailed if not."""
    if _json_object(payload) is None:
        raise WorkerFailed(worker, "decode", f"answer is not a JSON object: {payload[:80]!r}")
    return payload


def _refused_or_failed(worker: Any, leg: str, status: int, payload: bytes,
                       content_type: bytes | None) -> NoReturn:
    """A non-200 answer: the request's own fault (4xx but 408 and 429, passed to the client) or
    the worker's."""
    if 400 <= status < 500 and status not in (408, 429):
        # latin-1, as HTTP's header bytes: any bytes decode (a worker's odd Content-Type must
        # not turn its refusal into the router's 500)
        raise RequestRefused(status, payload, content_type.decode("latin-1") if content_type else None)
    raise WorkerFailed(worker, leg, f"HTTP {status}: {payload[:200]!r}")


# every other field of the answer (choices, usage, ...) is skipped, not built: a per-request cost.
# (defstruct, not a class body: native.py compiles this module, and mypyc gives a class's
# annotations its own runtime types, which msgspec would read)
_ParamsOnly = msgspec.defstruct("_ParamsOnly", [("kv_transfer_params", Any, None)])
_decode_params_only: Callable[[bytes], Any] = msgspec.json.Decoder(_ParamsOnly).decode


def answer_params(payload: bytes, worker: Any, leg: str) -> Any:
    """A leg's answer's kv_transfer_params, None if absent (WorkerFailed if the answer is not a
    JSON object)."""
    try:
        return _decode_params_only(payload).kv_transfer_params
    except msgspec.ValidationError:  # JSON, but not an object
        raise WorkerFailed(worker, leg, "answer is not a JSON object") from None
    except msgspec.DecodeError:
        raise WorkerFailed(worker, leg, f"answer is not JSON: {payload[:80]!r}") from None
