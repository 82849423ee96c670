"""The simplest aiohttp PD proxy (vLLM pull flow): a reference row for bench/router_overhead.py.

    .venv/bin/python -m bench.naive_proxy PREFILL_URL DECODE_URL PORT

No policy, metrics, timeouts, validation or failover: prefill with max_tokens 1 and
do_remote_decode, then decode with the prefill's kv_transfer_params, and relay the answer. It shows
what aiohttp's client and server cost on the machine, the floor under any aiohttp-based router.
"""

from __future__ import annotations

import uuid

import aiohttp
import msgspec
from aiohttp import web

from bench.common import reference_proxy_args
from pd_plugins.vocab.transfer_params import prefill_flags

_encode, _decode = msgspec.json.Encoder().encode, msgspec.json.Decoder().decode


def main() -> None:
    prefill, decode, port = reference_proxy_args(__doc__)
    session: aiohttp.ClientSession | None = None

    async def generate(request: web.Request) -> web.Response:
        body = _decode(await request.read())
        headers = {"Content-Type": "application/json", "X-Request-Id": uuid.uuid4().hex}
        leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": prefill_flags()}
        async with session.post(prefill + request.path, data=_encode(leg), headers=headers) as resp:
            answer = _decode(await resp.read())
        leg = {**body, "kv_transfer_params": answer["kv_transfer_params"]}
        async with session.post(decode + request.path, data=_encode(leg), headers=headers) as resp:
            return web.Response(body=await resp.read(), status=resp.status,
                                content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def client_session(app: web.Application):
        nonlocal session
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await session.close()

    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    app = web.Application()
    app.add_routes([web.post("/v1/completions", generate), web.get("/health", health)])
    app.cleanup_ctx.append(client_session)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


if __name__ == "__main__":
    main()
