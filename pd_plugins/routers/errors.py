"""The router's one error shape (OpenAI's): {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import msgspec
from aiohttp import web

_encode = msgspec.json.Encoder().encode


def error_body(status: int, message: str, param: str | None = None, kind: str | None = None) -> bytes:
    kind = kind or ("invalid_request_error" if status < 500 else "upstream_error")
    return _encode({"error": {"message": message, "type": kind, "param": param, "code": status}})


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(status, message, param),
                        content_type="application/json", headers=headers)
