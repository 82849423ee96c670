"""Admin API: list, add and remove workers while serving. Every call needs the bearer token."""

from __future__ import annotations

import hmac
import logging

import msgspec
from aiohttp import web

from pd_plugins.routers.config import ConfigError, WorkerConflict, WorkerSpec
from pd_plugins.routers.model_group import ModelNotFound, MoveRefused
from pd_plugins.routers.errors import error_response
from pd_plugins.routers.http_server import body_too_slow, read_body

log = logging.getLogger("pd_router.admin")


class WorkerChange(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    worker: WorkerSpec
    # the model the worker serves: needed to add one when the router serves several; when
    # removing, None finds the worker in whichever model has it
    model: str | None = None


class RoleChange(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    to: str
    model: str | None = None      # None: whichever model has the worker
    drain_timeout_s: float = 60.0  # the longest the move waits for requests of the old role


MAX_DRAIN_TIMEOUT_S = 3600.0
# GET /admin/in_flight: requests listed at most, and block keys in all: at most about 3 MB of
# JSON, 40 ms of the event loop on 2 loaded cores (5000 listed, of 20000 in flight)
MAX_IN_FLIGHT_LIMIT, MAX_IN_FLIGHT_KEYS = 5000, 100_000


class AdminApi:
    def __init__(self, router, token: str | None) -> None:
        self.router, self.token = router, token

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/admin/workers", self.list_workers),
                web.post("/admin/workers", self.add_worker),
                web.delete("/admin/workers", self.remove_worker),
                web.post("/admin/workers/role", self.move_worker),
                web.get("/admin/calibration", self.calibration),
                web.get("/admin/in_flight", self.in_flight)]

    def allows(self, request: web.Request) -> bool:
        """The request carries the admin token (for details elsewhere, e.g. /ready's workers)."""
        return self._denied(request) is None

    def _denied(self, request: web.Request) -> web.Response | None:
        if self.token is None:
            return error_response(403, "the admin API is off: start pd-router with --admin-token "
                                       "or PD_ROUTER_ADMIN_TOKEN")
        given = request.headers.get("Authorization", "")
        if not given.startswith("Bearer "):
            return error_response(401, "admin API needs 'Authorization: Bearer <token>'")
        # surrogateescape: aiohttp hands a header that is not UTF-8 over with surrogates, which a
        # plain encode() refuses (a 500 on /ready and /admin for anyone who sends one)
        if not hmac.compare_digest(given[7:].encode("utf-8", "surrogateescape"), self.token.encode()):
            return error_response(403, "wrong admin token")
        return None

    async def list_workers(self, request: web.Request) -> web.Response:
        if (denied := self._denied(request)) is not None:
            return denied
        return web.json_response({"workers": self.router.snapshot()})

    async def calibration(self, request: web.Request) -> web.Response:
        """Each model's fitted latency lines (perf/calibration.py loads them for the simulator)."""
        if (denied := self._denied(request)) is not None:
            return denied
        return web.json_response({"models": {name: calibration_of(group)
                                             for name, group in self.router.groups.items()}})

    async def in_flight(self, request: web.Request) -> web.Response:
        """The requests not ended yet, oldest first (`?model=`, `?limit=`; docs/router.md,
        "Traffic record"): what the traffic record does not hold yet."""
        if (denied := self._denied(request)) is not None:
            return denied
        if self.router.recorder is None:
            return error_response(404, "no in-flight list: it comes with the traffic record "
                                       "(--traffic-record or traffic_record: in the config)")
        try:
            limit = int(request.query.get("limit", MAX_IN_FLIGHT_LIMIT))
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_IN_FLIGHT_LIMIT:
            return error_response(400, f"limit must be an int within 1..{MAX_IN_FLIGHT_LIMIT}",
                                  "limit")
        listing = self.router.recorder.in_flight(request.query.get("model") or None, limit,
                                                 MAX_IN_FLIGHT_KEYS)
        return web.Response(body=msgspec.json.encode(listing), content_type="application/json")

    async def _change(self, request: web.Request) -> WorkerChange | web.Response:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            change = msgspec.json.decode(await read_body(request), type=WorkerChange)
        except TimeoutError:
            return body_too_slow()
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error_response(400, f"expected {{\"role\": ..., \"worker\": {{\"url\": ...}}}}: {exc}")
        if change.role not in ("prefill", "decode"):
            return error_response(400, f"role must be prefill or decode (got {change.role!r})", "role")
        return change

    async def add_worker(self, request: web.Request) -> web.Response:
        change = await self._change(request)
        if isinstance(change, web.Response):
            return change
        try:
            worker = await self.router.add_worker(change.worker, change.role, change.model)
        except ModelNotFound as missing:
            return error_response(missing.status, str(missing), "model")
        except WorkerConflict as conflict:  # already a worker of another model
            return error_response(409, str(conflict), "worker")
        except ConfigError as bad:  # e.g. a push-mode prefill without its NIXL side channel
            return error_response(400, str(bad), "worker")
        log.info("admin: added %s worker %s%s (healthy=%s)", change.role, worker.url,
                 f" of model {worker.model}" if worker.model else "", worker.healthy)
        return web.json_response({"added": worker.url, "role": change.role, "healthy": worker.healthy,
                                  **({"model": worker.model} if worker.model else {})})

    async def remove_worker(self, request: web.Request) -> web.Response:
        change = await self._change(request)
        if isinstance(change, web.Response):
            return change
        try:
            worker = self.router.remove_worker(change.worker.url, change.role, change.model)
        except ModelNotFound as missing:
            return error_response(missing.status, str(missing), "model")
        if worker is None:
            of = f" of model {change.model}" if change.model else ""
            return error_response(404, f"no {change.role} worker {change.worker.url}{of}")
        # this replica's requests (other replicas' load is counted in in_flight too)
        log.info("admin: removed %s worker %s (%d requests still finishing)", change.role,
                 worker.url, worker.own_in_flight)
        return web.json_response({"removed": worker.url, "role": change.role,
                                  "finishing": worker.own_in_flight,
                                  **({"model": worker.model} if worker.model else {})})

    async def move_worker(self, request: web.Request) -> web.Response:
        """Move a kv_both worker between the prefill and decode pools (docs/router.md, "Role
        changes"); answers once it serves its new role (after the drain)."""
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            change = msgspec.json.decode(await read_body(request), type=RoleChange)
        except TimeoutError:
            return body_too_slow()
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error_response(400, f"expected {{\"url\": ..., \"to\": \"prefill\"|\"decode\"}}: "
                                       f"{exc}")
        if change.to not in ("prefill", "decode"):
            return error_response(400, f"to must be prefill or decode (got {change.to!r})", "to")
        if not 0 <= change.drain_timeout_s <= MAX_DRAIN_TIMEOUT_S:
            return error_response(400, f"drain_timeout_s must be within 0..{MAX_DRAIN_TIMEOUT_S:.0f}",
                                  "drain_timeout_s")
        try:
            move = await self.router.move_worker(change.url, change.to, change.model,
                                                 change.drain_timeout_s)
        except ModelNotFound as missing:
            return error_response(missing.status, str(missing), "model")
        except MoveRefused as refused:
            return error_response(refused.status, str(refused), "url")
        worker = move.worker
        log.info("admin: moved worker %s from %s to %s (%d drained, %d still running)",
                 worker.url, move.old, move.to, move.drained, move.still_running)
        return web.json_response({"moved": worker.url, "from": move.old, "to": move.to,
                                  "drained": move.drained, "still_running": move.still_running,
                                  **({"model": worker.model} if worker.model else {})})


def calibration_of(group) -> dict:
    """A model group's latency models as fitted so far: the lines, the transfer priors, and how
    many samples each line has (below `min_samples` a line is still its configured prior)."""
    latency = group.latency
    prefill_a, prefill_b = latency.prefill.coefficients
    decode_a, decode_b = latency.decode_step.coefficients
    first = group.proxy.decode_first if group.proxy is not None else None
    first_a, first_b = first.coefficients if first is not None else (0.0, 0.0)
    return {"prefill_base_s": prefill_a, "prefill_per_token_s": prefill_b,
            "decode_step_base_s": decode_a, "decode_step_per_request_s": decode_b,
            "kv_bytes_per_token": latency.priors.kv_bytes_per_token,
            "link_bytes_per_s": latency.priors.link_bytes_per_s,
            # pull flow, decode leg to first token = base + per_token * tokens it pulled
            "decode_first_base_s": first_a, "decode_first_per_token_s": first_b,
            "block_size": group.ctx.block_size,
            "samples": {"prefill": latency.prefill.n, "decode_step": latency.decode_step.n,
                        "decode_first": first.n if first is not None else 0,
                        "min_samples": latency.prefill.min_samples}}
