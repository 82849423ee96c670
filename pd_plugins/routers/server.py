"""The pd-router HTTP server: OpenAI endpoints, health, readiness, metrics, admin."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import Awaitable, Iterator

import aiohttp
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pd_plugins.routers.admin import AdminApi
from pd_plugins.routers.client_auth import api_key_check, api_key_middleware, load_api_keys, tls_context
from pd_plugins.routers.config import RouterConfig, WorkerConflict, WorkerSpec
from pd_plugins.routers.discovery import kubernetes_watcher, plan_kubernetes
from pd_plugins.routers.flows import profile_for
from pd_plugins.routers.health import PoolUpkeep
from pd_plugins.routers import http_server
from pd_plugins.routers.http_server import (FastRequest, FrontServer, answered, body_too_slow,
                                            read_body)
from pd_plugins.routers.kv_sources.pools import PoolView
from pd_plugins.routers.metrics import RouterMetrics
from pd_plugins.routers.replica_channels import LoadChannel
from pd_plugins.routers.replica_sync import RedisLog, ReplicaSync, replica_sync_for
from pd_plugins.routers.model_group import ModelGroup, ModelNotFound, MoveRefused, RoleMove
from pd_plugins.routers.errors import error_response
from pd_plugins.routers.request import BadRequest, Tokenize, parse_request
from pd_plugins.routers.tokenizer import load_tokenizer
from pd_plugins.routers.traffic_record import TrafficRecorder
from pd_plugins.routers.upstream import Pools, new_session
from pd_plugins.routers.workers import Worker

log = logging.getLogger("pd_router")

ENDPOINTS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


MAX_LISTED_NAMES = 50  # model names an error message lists (adapters can be many)
# With discovery, the replica sync starts once discovery's first list is applied: the stream's
# history (peers' pins) is read against the pods' workers, not an empty pool (a pin to a decode
# the pool does not know is refused, and pins are only republished when they change). Past this,
# it starts anyway (discovery's API unreachable: sharing goes on without that history).
SYNC_AFTER_DISCOVERY_S = 30.0


class _AllWorkers:
    """Every model's workers, iterated afresh (health upkeep and /metrics walk them all)."""

    def __init__(self, groups: dict[str, ModelGroup]) -> None:
        self.groups = groups

    def __iter__(self) -> Iterator[Worker]:
        return (w for group in list(self.groups.values()) for w in group.pool)


class Router:
    """Owns the model groups, the health upkeep and the HTTP clients; builds the aiohttp app."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.profile = profile_for(config.engine)
        tokenizers: dict[str, Tokenize] = {}  # one load per path, shared by the models

        def tokenizer(path: str) -> Tokenize:
            if path not in tokenizers:
                tokenizers[path] = load_tokenizer(path)
            return tokenizers[path]

        self.groups: dict[str, ModelGroup] = {}
        for spec in config.model_groups():
            self.groups[spec.name] = ModelGroup(config, spec, self.profile, tokenizer)
        self.named = bool(config.models)  # False: one unnamed group, served names all learned
        untokenized = [m.name for m in config.models if not m.tokenizer]
        if config.tokenizer and untokenized:  # another model's vocabulary would key them wrong
            log.warning("the top-level tokenizer is not used by models: model(s) %s have none of "
                        "their own (text prompts' tokens are estimated)", ", ".join(untokenized))
        if config.sessions.redis_url is not None:
            RedisLog.check_installed()
        self.sync: ReplicaSync | None = None  # replicas sharing state through Redis (startup)
        self.workers = _AllWorkers(self.groups)
        self.metrics = RouterMetrics(self.workers, [g.sessions for g in self.groups.values()],
                                     by_model=self.named)
        self.session: aiohttp.ClientSession | None = None
        self.pools = Pools(config.timeouts.connect_s)  # the legs' connections, one pool per worker
        self._pool_views: dict[str, PoolView] = {}  # kv_pool value -> its view
        # request `model` -> its group, rebuilt when workers change (a lookup per request)
        self._by_name: dict[str, ModelGroup] = {}
        self._known = ""  # the served names, for error messages
        self._conflicts: set[str] = set()  # names two models claim (logged once)
        self.upkeep: PoolUpkeep | None = None
        self._loop_watch = None  # the event-loop lag probe (metrics.py), from startup
        self.admin = AdminApi(self, config.admin_token)
        # the edge: both read here, so --check-config and startup fail on a bad key file or cert
        self.api_keys = load_api_keys(config)
        self.api_key_check = (api_key_check(self.api_keys, config.metrics_need_api_key)
                              if self.api_keys else None)
        self.tls = tls_context(config.tls_cert, config.tls_key) if config.tls_cert else None
        # Kubernetes discovery: checked here (selector, kubeconfig), watching from startup
        self.discovery_plan = plan_kubernetes(config.discovery) if config.discovery else None
        self.discovery = None
        self._sync_start: asyncio.Task | None = None  # with discovery: the sync's delayed start
        # what it routes, one JSON line per request (opt-in; routers/traffic_record.py)
        self.recorder = TrafficRecorder(config.traffic_record) if config.traffic_record else None
        self.refresh_served()

    def _only_group(self) -> ModelGroup:
        if len(self.groups) != 1:
            raise ModelNotFound(f"this router serves several models ({self._known}): name one", 400)
        return next(iter(self.groups.values()))

    # -- lifecycle --------------------------------------------------------------------------
    async def startup(self, app: web.Application) -> None:
        self.session = new_session(self.config.timeouts.connect_s)
        if self.config.sessions.redis_url is not None:
            self.sync = replica_sync_for(self.config.sessions)
            self.sync.add(LoadChannel(lambda: self.workers, self.config.sessions.peer_load_ttl_s))
            self.metrics.registry.register(self.sync.collector())
        if self.recorder is not None:
            self.recorder.start()
            self.metrics.registry.register(self.recorder.collector())
        for group in self.groups.values():
            await group.start(self.metrics, self.pools, self._pool_views, self.sync)
            group.proxy.recorder = self.recorder
        if self.sync is not None and self.discovery_plan is None:
            await self.sync.start()  # in the background: no request waits on Redis
        self.upkeep = PoolUpkeep(self.config, self.workers, self.session)
        for group in self.groups.values():  # verdicts name the pair: attribution (kv_quarantine.py)
            group.proxy.kv_quarantine = self.upkeep.kv
        if self.upkeep.kv is not None:
            self.metrics.registry.register(self.upkeep.kv.collector())
        self._loop_watch = self.metrics.watch_loop()
        await self.upkeep.check_all()  # know health and models before the first request
        self.refresh_served()
        self.upkeep.on_change = self.refresh_served
        self.upkeep.start()
        if self.discovery_plan is not None:  # pd.model label -> model; unnamed: every pod
            models = {g.spec.pod_label: g.name for g in self.groups.values()} if self.named else None
            self.discovery = kubernetes_watcher(self, self.discovery_plan, models)
            self.metrics.registry.register(self.discovery.collector())
            self.discovery.start()
            log.info("kubernetes discovery: watching %s", self.discovery_plan.describe())
            if self.sync is not None:  # after the first list; readiness does not wait for it
                self._sync_start = asyncio.create_task(
                    self._start_sync_after_discovery(SYNC_AFTER_DISCOVERY_S),
                    name="pd-router replica sync start")
        counts = ", ".join(f"{g.name or 'model'}: {len(g.pool.by_role('prefill'))} prefill, "
                           f"{len(g.pool.by_role('decode'))} decode" for g in self.groups.values())
        log.info("pd-router ready on %s://%s:%d: %s (%s, %s)%s",
                 "https" if self.tls else "http", self.config.host, self.config.port, counts,
                 self.config.engine, self.config.mode,
                 f"; {len(self.api_keys)} API key(s)" if self.api_keys else "")

    async def _start_sync_after_discovery(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await self.discovery.synced.wait()
        except TimeoutError:
            log.warning("replica sync: kubernetes discovery has not listed pods within %g s; "
                        "starting the sync anyway (peers' pins to decode workers not known yet "
                        "are refused)", timeout_s)
        # the list's workers join the pool in tasks it made before `synced` was set: their
        # first step (the pool add, before the probe) runs ahead of this
        await asyncio.sleep(0)
        await self.sync.start()

    async def cleanup(self, app: web.Application) -> None:
        if self._sync_start is not None:  # before sync.aclose: a sync cut short never starts
            self._sync_start.cancel()
            await asyncio.gather(self._sync_start, return_exceptions=True)
        if self._loop_watch is not None:
            self._loop_watch.cancel()
        if self.discovery is not None:
            await self.discovery.stop()
        if self.upkeep:
            await self.upkeep.stop()
        for group in self.groups.values():
            await group.stop()
        if self.sync is not None:
            await self.sync.aclose()
        if self.recorder is not None:  # writes what is queued (a thread: the loop keeps going)
            await asyncio.to_thread(self.recorder.close)
        for view in self._pool_views.values():
            view.close()
        if self.session:
            await self.session.close()
            await self.pools.close()

    # -- workers (admin API, discovery) -----------------------------------------------------
    def group_for(self, model: str | None) -> ModelGroup:
        """The group a caller means: `model` by its configured or served name; None (or "")
        with a single group: that one. ModelNotFound otherwise."""
        if model:
            group = self.groups.get(model) or self._by_name.get(model)
            if group is not None:
                return group
            if not self.named and model in self.groups[""].served:
                return self.groups[""]
            raise ModelNotFound(f"model {model!r} is not served here; available: {self._known}")
        return self._only_group()

    async def add_worker(self, spec: WorkerSpec, role: str, model: str | None = None) -> Worker:
        group = self.group_for(model)
        for other in self.groups.values():  # the rules _validate_models applies at startup
            if other is group:
                continue
            if other.pool.get(spec.url, "prefill") or other.pool.get(spec.url, "decode"):
                raise WorkerConflict(f"worker {spec.url} already serves model {other.name!r} "
                                     "(an engine serves one model)")
            if spec.kv_pool and any(w.spec.kv_pool == spec.kv_pool for w in other.pool):
                raise WorkerConflict(f"kv_pool {spec.kv_pool!r} already holds model "
                                     f"{other.name!r}'s KV: give each model its own pool")
        worker = group.add(spec, role)
        group.subscribe(worker, self._pool_views)
        if self.upkeep and not worker.probing:
            await self.upkeep.check(worker)
        self.refresh_served()
        return worker

    def remove_worker(self, url: str, role: str, model: str | None = None) -> Worker | None:
        """Drain a worker (requests it holds finish); `model` None: whichever model has it."""
        groups = [self.group_for(model)] if model else list(self.groups.values())
        for group in groups:
            worker = group.remove(url, role)
            if worker is not None:
                # a kv_both worker may still hold the other role
                if not any(g.has_worker(worker.url) for g in self.groups.values()):
                    self.pools.forget(worker.url)
                self._release_pool_view(worker.spec.kv_pool)
                self.refresh_served()
                return worker
        return None

    def _release_pool_view(self, kv_pool: str | None) -> None:
        """A shared KV pool no worker names any more: its view is closed (a PdShm pool's mapping
        and file unmapped, so removing the pool frees its memory) and dropped."""
        if kv_pool is None or kv_pool not in self._pool_views:
            return
        if any(w.spec.kv_pool == kv_pool for g in self.groups.values() for w in g.pool):
            return
        self._pool_views.pop(kv_pool).close()

    async def move_worker(self, url: str, to: str, model: str | None = None,
                          drain_timeout_s: float = 60.0, spec: WorkerSpec | None = None) -> RoleMove:
        """Move a kv_both worker between its model's prefill and decode pools, draining its
        requests of the old role first (ModelGroup.move_worker); `model` None: whichever has it."""
        url = url.rstrip("/")
        if model:
            group = self.group_for(model)
        else:
            group = next((g for g in self.groups.values()
                          if g.pool.get(url, "prefill") or g.pool.get(url, "decode")), None)
            if group is None:
                raise MoveRefused(f"no worker {url}", 404)
        try:
            return await group.move_worker(url, to, drain_timeout_s, spec)
        finally:
            self.refresh_served()

    # -- serving ----------------------------------------------------------------------------
    def refresh_served(self) -> None:
        """Each group's served names and context length, and the name -> group table, recomputed
        when workers change (not per request). A configured name always leads to its own model;
        an adapter two models both serve goes to the first in the config (logged once)."""
        by_name: dict[str, ModelGroup] = {name: g for name, g in self.groups.items() if name}
        configured = frozenset(by_name)
        for group in self.groups.values():
            group.refresh(configured - {group.name})
            for name in group.served:
                owner = by_name.setdefault(name, group)
                if owner is not group and name not in self._conflicts:
                    self._conflicts.add(name)
                    log.warning("model name %r is served by workers of %r and %r: requests for it "
                                "go to %r", name, owner.name, group.name, owner.name)
        self._by_name = by_name
        names = sorted(by_name)
        more = len(names) - MAX_LISTED_NAMES
        self._known = ", ".join(names[:MAX_LISTED_NAMES]) + (f" and {more} more" if more > 0 else "")

    def select_model(self, model: str | None) -> ModelGroup:
        """The group of a request's `model` (parse_request's select_model)."""
        if model is not None:
            group = self._by_name.get(model)
            if group is not None:
                return group
        if not self.named:  # one unnamed group: any model while its workers have listed none
            if model is None or not self._by_name:
                return self.groups[""]
        elif model is None:
            if len(self.groups) == 1:
                return next(iter(self.groups.values()))
            raise BadRequest(400, f"'model' is required: this router serves several models "
                                  f"({self._known})", param="model")
        raise BadRequest(404, f"model {model!r} is not served here; available: {self._known}",
                         param="model")

    async def generate(self, http: web.Request) -> web.StreamResponse:
        """An inference request that aiohttp's server read (the front server's: `answer`)."""
        try:
            raw = await read_body(http)
        except TimeoutError:  # an aiohttp request whose body never completes
            self.metrics.rejections.labels("read_timeout").inc()
            return body_too_slow()
        except web.HTTPRequestEntityTooLarge:
            return self._too_large()
        return await self._serve(http, raw)

    def answer(self, http: FastRequest) -> Awaitable[web.StreamResponse]:
        """generate() for the front server, which has read the body already. Not a coroutine
        itself: the request's task runs the proxy's coroutine with none of its own above it (each
        wake-up of the task resumes every coroutine level; bench/router_instructions.py measured
        this 3% of a PD request's cycles)."""
        try:
            raw = http.body()
        except web.HTTPRequestEntityTooLarge:
            return answered(self._too_large())
        return self._serve(http, raw)

    def _serve(self, http: web.Request | FastRequest, raw: bytes) -> Awaitable[web.StreamResponse]:
        path = http.path
        try:
            request = parse_request(
                raw, ENDPOINTS[path], http.headers, select_model=self.select_model,
                strip_transfer_fields=self.config.client_transfer_fields == "strip")
        except BadRequest as bad:
            self.metrics.rejections.labels("bad_request").inc()
            return answered(error_response(bad.status, bad.message, bad.param))
        return request.target.proxy.serve(http, request, path)

    def _too_large(self) -> web.Response:
        self.metrics.rejections.labels("too_large").inc()
        return error_response(413, f"request body exceeds {self.config.max_body_bytes} bytes")

    async def models(self, http: web.Request) -> web.Response:
        data = []
        for name, group in sorted(self._by_name.items()):
            entry = {"id": name, "object": "model", "owned_by": "pd-router",
                     "max_model_len": group.max_model_len}
            parent = group.adapter_parents.get(name)
            if parent is not None:
                entry["parent"] = parent
            data.append(entry)
        return web.json_response({"object": "list", "data": data})

    async def health(self, http: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, http: web.Request) -> web.Response:
        """Counts for every probe (per model too, with several); the workers (URLs, load) only
        with the admin token. Ready while some model has a usable decode worker."""
        counts = {name: group.usable_counts() for name, group in self.groups.items()}
        decodes = sum(c["usable_decode"] for c in counts.values())
        prefills = sum(c["usable_prefill"] for c in counts.values())
        body: dict = {"ready": decodes > 0, "usable_decode": decodes, "usable_prefill": prefills}
        if self.named:
            body["models"] = {name: {"ready": c["usable_decode"] > 0, **c} for name, c in counts.items()}
        if self.admin.allows(http):
            body["workers"] = self.snapshot()
        return web.json_response(body, status=200 if decodes > 0 else 503)

    def snapshot(self) -> list[dict]:
        return [entry for group in self.groups.values() for entry in group.pool.snapshot()]

    async def prometheus(self, http: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    def app(self) -> web.Application:
        middlewares = [api_key_middleware(self.api_key_check)] if self.api_key_check else []
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=middlewares)
        app.add_routes([web.post(path, self.generate) for path in ENDPOINTS])
        app.add_routes([web.get("/v1/models", self.models), web.get("/health", self.health),
                        web.get("/ready", self.ready), web.get("/metrics", self.prometheus)])
        app.add_routes(self.admin.routes())
        app.on_startup.append(self.startup)
        app.on_cleanup.append(self.cleanup)
        return app

    async def serve(self, shutdown_timeout_s: float = 60.0) -> None:
        """Listen until SIGTERM or SIGINT, then drain: the inference endpoints on the front
        server (http_server.py), every other request on the aiohttp app it hands over to."""
        # handler_cancellation: a client that disconnects cancels its handler, which closes both
        # legs, so the engines abort the request and free its KV (aiohttp's default is off).
        # keepalive_timeout: the front server's own for the connections handed to aiohttp
        # (aiohttp's default keeps an idle one for an hour)
        runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True,
                               shutdown_timeout=shutdown_timeout_s,
                               keepalive_timeout=http_server.KEEPALIVE_TIMEOUT_S)
        await runner.setup()  # the app's startup: workers probed, upkeep and sync running
        # What startup built (app, config, tokenizers, metrics) lives as long as the process:
        # frozen, the collector's full passes no longer walk it (shorter GC pauses, less CPU).
        gc.collect()
        gc.freeze()
        assert runner.server is not None
        front = FrontServer(self.answer, runner.server, max_body=self.config.max_body_bytes,
                            authorize=self.api_key_check,
                            max_connections=self.config.max_connections)
        self.metrics.registry.register(FrontCollector(front))
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        try:
            listener = await loop.create_server(front, self.config.host, self.config.port,
                                                ssl=self.tls, reuse_address=True, backlog=1024)
            try:
                await stop.wait()
            finally:
                listener.close()  # no new connections; those open finish what they hold
                await front.shutdown(shutdown_timeout_s)
        finally:
            await runner.cleanup()


class FrontCollector:
    """/metrics: the client connections the front server holds, and those it refused past
    max_connections (each answered 503)."""

    def __init__(self, front: FrontServer) -> None:
        self.front = front

    def collect(self):
        yield GaugeMetricFamily("pd_router_client_connections", "Client connections open (the "
                                "front server's and those handed to the admin/metrics app)",
                                value=len(self.front.connections) + len(self.front.fallback.connections))
        yield CounterMetricFamily("pd_router_refused_connections", "Client connections refused "
                                  "(503) past max_connections", value=self.front.refused_connections)
