"""The router as the edge: client API keys on /v1/* and TLS on its listener, both optional.

Keys come from the config's `api_keys`, `api_key_file` (one per line, `#` comments) and
PD_ROUTER_API_KEYS (comma-separated, merged in by the CLI). With none configured the API is open, as
an engine's is; with any, a request needs `Authorization: Bearer <key>` (401 otherwise). The
router keeps only the keys' SHA-256 digests and looks the given key's digest up in a set: the time
that takes does not depend on how much of a key matched, nor on how many keys there are. /health and /ready stay open for probes (/ready's details need the admin token);
/metrics is covered only with `metrics_need_api_key`.
"""

from __future__ import annotations

import hashlib
import ssl
from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web

from pd_plugins.routers.config import ConfigError, RouterConfig
from pd_plugins.routers.errors import error_body

MAX_KEYS = 10_000
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def load_api_keys(config: RouterConfig) -> list[bytes]:
    keys = list(config.api_keys)
    if config.api_key_file:
        try:
            lines = Path(config.api_key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read api_key_file {config.api_key_file}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ConfigError(f"api_key_file {config.api_key_file} holds no key")
    for key in keys:
        if not key or not key.isascii() or not key.isprintable() or " " in key:
            raise ConfigError("an API key must be printable ASCII without spaces")
    if len(keys) > MAX_KEYS:
        raise ConfigError(f"more than {MAX_KEYS} API keys")
    return [key.encode() for key in dict.fromkeys(keys)]


def api_key_check(keys: list[bytes], cover_metrics: bool) -> Callable[[str, str], web.Response | None]:
    """check(path, Authorization header) -> a 401 to send, or None if the request may pass.
    Used by the aiohttp middleware and by the front server's inference path (http_server.py)."""
    digests = frozenset(hashlib.sha256(key).digest() for key in keys)
    protected = ("/v1/", "/metrics") if cover_metrics else ("/v1/",)

    def check(path: str, given: str) -> web.Response | None:
        if not path.startswith(protected):
            return None
        token = given[7:].strip().encode("utf-8", "surrogateescape") \
            if given[:7].lower() == "bearer " else b""
        # a digest lookup: no timing hint about which key was close, O(1) in the key count
        if token and hashlib.sha256(token).digest() in digests:
            return None
        return web.Response(
            status=401, content_type="application/json",
            headers={"WWW-Authenticate": 'Bearer realm="pd-router"'},
            body=error_body(401, "a valid API key is needed: 'Authorization: Bearer <key>'",
                            kind="authentication_error"))

    return check


def api_key_middleware(check: Callable[[str, str], web.Response | None]):
    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        refusal = check(request.path, request.headers.get("Authorization", ""))
        return refusal if refusal is not None else await handler(request)

    return check_api_key


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A server context with Python's secure defaults (TLS 1.2 or later)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS certificate {cert} / key {key}: {exc}") from None
    return context
