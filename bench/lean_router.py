"""pd-router's own per-request work on the floor proxy's I/O: a reference row for
bench/router_overhead.py (`--targets ... lean`), non-streaming only.

    .venv/bin/python -m bench.lean_router PD-ROUTER-FLAGS...   # e.g. --prefill URL --decode URL

It answers where pd-router's CPU above the floor proxy (bench/floor_proxy.py) goes (issue 30): to
its I/O framework (the front server's aiohttp-shaped request and response, a task and a chain of
coroutines per request, a future per leg, the legs' client) or to the work it does per request.
This runs that work as pd-router runs it, through pd-router's own objects built from the same flags
(`Router`: its model group, proxy, scheduler, accounting and metrics): the request checks
(`parse_request`), the policy (`schedule`, `admit`), the prefill leg's accounting and answer
(`kv_transfer_params`, its `pd` section), the decode leg's accounting, the route header, the KV
verdict and the request's end (`Proxy._finish`: metrics, accounting); each leg under a
per-connection timeout (`Deadline`), as pd-router's legs. The I/O is the floor proxy's: protocol
callbacks from the client's bytes to the answer's last byte, keep-alive connections from a free
list. vLLM's pull flow only: at startup it refuses the flags it does not mirror (another engine or
transfer mode, a tokenizer, sessions, a traffic record), and a request pd-router would not send
disaggregated (no route, refused by admission, prefilled on its decode) is answered 503.

It is not a router: it has no failover, no client-gone or slow-client handling, no bounds on a
request's head or body or on an answer, and no streaming; GET /metrics is pd-router's exposition
and any other GET is answered 200 "ok" (health). So the difference between its row and pd-router's
is an upper bound on what rewriting the I/O alone saves.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time

from aiohttp import web

from bench.floor_proxy import Pool, RequestReader, Upstream
from pd_plugins.routers import accounting, cli
from pd_plugins.routers.deadline import Deadline
from pd_plugins.routers.flows.base import Attempt
from pd_plugins.routers.flows.vllm import vllm_prefill_body
from pd_plugins.routers.http_server import (KEEPALIVE_TIMEOUT_S as KEEPALIVE_S,
                                            READ_TIMEOUT_S as READ_S, RequestHeaders, header_map)
from pd_plugins.routers.request import BadRequest, leg_json, parse_request
from pd_plugins.routers.server import ENDPOINTS, Router
from pd_plugins.routers.upstream import answer_params
from pd_plugins.vocab.transfer_params import pd_section_of, stored_tokens_of

OK_JSON = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nx-pd-route: %b\r\n"
           b"Content-Length: %d\r\n\r\n")
BAD = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"
NOT_DISAGGREGATED = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"
METRICS = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: %d\r\n\r\n"


class TimedUpstream(Upstream):
    """The floor's connection with a leg's timeout, as pd-router's legs have (one per connection,
    re-armed per request: routers/deadline.py)."""

    def __init__(self, pool: Pool) -> None:
        super().__init__(pool)
        self.deadline = Deadline(asyncio.get_running_loop(), self._timed_out)

    def _timed_out(self) -> None:
        self.transport.abort()

    def on_message_complete(self) -> None:
        self.deadline.disarm()
        super().on_message_complete()


class LegPool(Pool):
    """The floor's pool with pd-router's leg head (X-Request-Id) and the leg's timeout."""

    connection = TimedUpstream

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.head = self.head.replace(b"\r\n\r\n", b"\r\nX-Request-Id: %s\r\n\r\n")

    def leg(self, path: bytes, body: bytes, request_id: bytes, timeout_s: float,
            on_body, on_done) -> None:
        data = self.head % (path, len(body), request_id) + body

        def go(conn: TimedUpstream) -> None:
            conn.sink, conn.on_done = on_body, on_done
            conn.deadline.arm(timeout_s)
            conn.transport.write(data)

        self.acquire(go)


class Front(RequestReader):
    """The floor's request reader, with the front server's keep-alive and read timeouts and the
    request's headers (pd-router's checks read some)."""

    def __init__(self, router: Router, pools: dict[str, LegPool]) -> None:
        super().__init__()
        self.router, self.pools = router, pools
        self.deadline = Deadline(asyncio.get_running_loop(), self._timed_out)

    def _timed_out(self) -> None:
        self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.headers: dict[bytes, bytes] = {}
        self.deadline.arm(KEEPALIVE_S)

    def data_received(self, data: bytes) -> None:
        self.deadline.arm(READ_S)
        super().data_received(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.setdefault(name, value)

    def on_message_complete(self) -> None:
        self.deadline.disarm()  # armed again when the answer is written (keep-alive)
        self.request_headers, self.headers = self.headers, {}
        super().on_message_complete()

    def on_get(self, url: bytes) -> bytes:
        self.deadline.arm(KEEPALIVE_S)
        if url == b"/metrics":  # pd-router's own counters: the bench's "served" column, the test
            body = self.router.metrics.exposition()
            return METRICS % len(body) + body
        return super().on_get(url)

    def reply(self, data: bytes) -> None:
        """A whole answer; the connection then idles under its keep-alive timeout."""
        if not self.transport.is_closing():
            self.transport.write(data)
            self.deadline.arm(KEEPALIVE_S)

    def serve(self, url: bytes, raw: bytes) -> None:
        headers = RequestHeaders(header_map(self.request_headers))
        path = url.decode("latin-1")
        if path not in ENDPOINTS:
            self.reply(BAD)
            return
        router, started = self.router, time.monotonic()
        try:
            request = parse_request(raw, ENDPOINTS[path], headers, select_model=router.select_model,
                                    strip_transfer_fields=router.config.client_transfer_fields == "strip")
        except BadRequest:
            self.reply(BAD)
            return
        proxy, info = request.target.proxy, request.info
        decision = proxy.scheduler.schedule(info)
        if (decision is None or decision.prefill is None
                or proxy.scheduler.admit(info, decision) is not None):
            self.reply(NOT_DISAGGREGATED)
            return
        attempt = Attempt(request, decision, f"{proxy._id_prefix}-{next(proxy._ids)}-0", path)
        prefill, decode, ctx, timeouts = decision.prefill, decision.decode, proxy.ctx, proxy.timeouts
        request_id = attempt.request_id.encode()
        charge = accounting.prefill_started(ctx, prefill, info)
        answer: list[bytes] = []
        prefill_started = time.monotonic()

        def prefill_done() -> None:
            accounting.prefill_ended(prefill, info, charge)
            elapsed = time.monotonic() - prefill_started
            proxy.metrics.prefill_leg.observe(elapsed)
            params = answer_params(b"".join(answer), prefill, "prefill")
            section = pd_section_of(params)
            stored_tokens_of(params)  # (what a pool stored: pd-router records it; none here)
            accounting.prefill_succeeded(ctx, prefill, info, charge, elapsed,
                                         section.cached_tokens if section is not None else None,
                                         proxy.record_prefixes)
            decode_charge = accounting.decode_started(decode, info)
            decode_started = time.monotonic()
            out: list[bytes] = []

            def decode_done() -> None:
                accounting.decode_ended(decode, info, decode_charge)
                decode.record_success()
                payload = b"".join(out)
                header = proxy._route_header(decision, [], info, proxy._kv_verdict(payload, decision))
                proxy.finish(attempt, started, decode_started)
                self.reply(OK_JSON % (header.encode(), len(payload)) + payload)

            self.pools[decode.url].leg(url, leg_json(request.body_with({"kv_transfer_params": params})),
                                       request_id, timeouts.decode_total_s, out.append, decode_done)

        self.pools[prefill.url].leg(url, leg_json(vllm_prefill_body(request.body)), request_id,
                                    timeouts.prefill_s, answer.append, prefill_done)


def unmirrored(config) -> list[str]:
    """The flags whose per-request work this does not run as pd-router would."""
    return [what for what, set_ in (
        (f"--engine {config.engine}", config.engine != "vllm"),
        (f"--transfer {config.transfer}", config.transfer != "pull"),
        ("a tokenizer", bool(config.tokenizer) or any(m.tokenizer for m in config.models)),
        ("sessions in Redis", config.sessions.redis_url is not None),
        ("a traffic record", config.traffic_record is not None)) if set_]


def main() -> None:
    config = cli.config_from_args(cli.build_parser().parse_args(sys.argv[1:]))
    refused = unmirrored(config)
    if refused:
        sys.exit(f"lean_router: runs pd-router's vLLM pull flow only; not with {', '.join(refused)}")
    router = Router(config)
    import uvloop

    async def serve() -> None:
        runner = web.AppRunner(router.app(), access_log=None)
        await runner.setup()  # pd-router's startup: workers probed, policy and metrics ready
        gc.collect()  # as pd-router does (server.py): what startup built is frozen
        gc.freeze()
        pools = {w.url: LegPool(w.url) for w in router.workers}
        await asyncio.get_running_loop().create_server(lambda: Front(router, pools), config.host,
                                                       config.port)
        await asyncio.Event().wait()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
