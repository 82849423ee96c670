"""HTTP legs to the workers, and how their failures are classified.

A leg either succeeds, fails because of the worker (connection refused or reset, timeout, 5xx, 429,
a malformed answer): `WorkerFailed`, which the proxy may retry elsewhere; or the worker refuses the
request itself (4xx): `RequestRefused`, which is passed to the client as it is, because another
worker would refuse it too.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
JSON_HEADERS = {"Content-Type": "application/json"}


class WorkerFailed(Exception):
    def __init__(self, worker: Any, leg: str, message: str) -> None:
        super().__init__(f"{leg} on {worker.url}: {message}")
        self.worker, self.leg, self.message = worker, leg, message


class RequestRefused(Exception):
    def __init__(self, status: int, body: bytes, content_type: str | None) -> None:
        super().__init__(f"worker refused the request with {status}")
        self.status, self.body, self.content_type = status, body, content_type


def new_session(connect_timeout_s: float) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, enable_cleanup_closed=True)
    return aiohttp.ClientSession(
        connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
        skip_auto_headers=("User-Agent",),
    )


async def open_leg(session: aiohttp.ClientSession, worker: Any, leg: str, path: str,
                   body: dict[str, Any], request_id: str, timeout_s: float) -> aiohttp.ClientResponse:
    """POST and wait for the response headers; non-2xx answers are classified and raised."""
    headers = {**JSON_HEADERS, "X-Request-Id": request_id}
    try:
        resp = await asyncio.wait_for(
            session.post(worker.url + path, data=_encode(body), headers=headers), timeout_s)
    except asyncio.TimeoutError:
        raise WorkerFailed(worker, leg, f"no response within {timeout_s:g} s") from None
    except aiohttp.ClientError as exc:
        raise WorkerFailed(worker, leg, f"{type(exc).__name__}: {exc}") from None
    if resp.status == 200:
        return resp
    try:
        payload = await asyncio.wait_for(resp.read(), timeout_s)
    except (asyncio.TimeoutError, aiohttp.ClientError):
        payload = b""
    finally:
        resp.release()
    if 400 <= resp.status < 500 and resp.status not in (408, 429):
        raise RequestRefused(resp.status, payload, resp.headers.get("Content-Type"))
    raise WorkerFailed(worker, leg, f"HTTP {resp.status}: {payload[:200]!r}")


async def json_leg(session: aiohttp.ClientSession, worker: Any, leg: str, path: str,
                   body: dict[str, Any], request_id: str, timeout_s: float) -> dict[str, Any]:
    """A whole non-streaming leg, parsed; a body that is not a JSON object is the worker's fault."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    resp = await open_leg(session, worker, leg, path, body, request_id, timeout_s)
    try:
        payload = await asyncio.wait_for(resp.read(), max(0.001, deadline - loop.time()))
    except asyncio.TimeoutError:
        resp.close()
        raise WorkerFailed(worker, leg, f"no complete answer within {timeout_s:g} s") from None
    except aiohttp.ClientError as exc:
        raise WorkerFailed(worker, leg, f"{type(exc).__name__}: {exc}") from None
    try:
        data = _decode(payload)
    except msgspec.DecodeError:
        raise WorkerFailed(worker, leg, f"answer is not JSON: {payload[:80]!r}") from None
    if not isinstance(data, dict):
        raise WorkerFailed(worker, leg, "answer is not a JSON object")
    return data
