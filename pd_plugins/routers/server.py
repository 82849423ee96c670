"""The pd-router HTTP server: OpenAI endpoints, health, readiness, metrics, admin."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from pd_plugins.routers.admin import AdminApi
from pd_plugins.routers.client_auth import api_key_middleware, load_api_keys, tls_context
from pd_plugins.routers.config import RouterConfig, WorkerSpec
from pd_plugins.routers.flows import profile_for
from pd_plugins.routers.health import PoolUpkeep
from pd_plugins.routers.kv_sources.events import KvEventSubscriber
from pd_plugins.routers.kv_sources.pools import PoolView, pool_view
from pd_plugins.routers.metrics import RouterMetrics
from pd_plugins.routers.policy import PolicyContext, Scheduler
from pd_plugins.routers.policy.latency_model import LatencyModels
from pd_plugins.routers.policy.prefix_index import PrefixIndex
from pd_plugins.routers.proxy import Proxy, error_response
from pd_plugins.routers.request import BadRequest, parse_request
from pd_plugins.routers.tokenizer import load_tokenizer
from pd_plugins.routers.session_store import RedisSessionStore, SessionSharing
from pd_plugins.routers.sessions import SessionTable
from pd_plugins.routers.upstream import Pools, new_session
from pd_plugins.routers.workers import Worker, WorkerPool

log = logging.getLogger("pd_router")

ENDPOINTS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


class Router:
    """Owns the pool, the scheduler and the upkeep tasks; builds the aiohttp app."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.profile = profile_for(config.engine)
        self.profile.check_workers(config)
        self.pool = WorkerPool()
        self.prefix_index = PrefixIndex()
        self.latency = LatencyModels(config.latency)
        self.ctx = PolicyContext(self.pool, self.prefix_index, self.latency, config.block_size)
        fixed = config.decode[0].url if config.mode == "sidecar" else None
        self.scheduler = Scheduler(config.policy, self.ctx, fixed_decode_url=fixed,
                                   local_prefill=self.profile.decode_prefills_locally)
        self.sessions = SessionTable(config.sessions) if self.scheduler.uses_sessions else None
        self.sharing: SessionSharing | None = None  # made in startup (needs the event loop)
        if config.sessions.redis_url is not None:
            if self.sessions is None:
                log.warning("sessions.redis_url is set but the policy tracks no sessions "
                            "(no session_pin / append_prefill): Redis unused")
            else:
                RedisSessionStore.check_installed()
                for event in ("store_error", "store_adopted"):  # on /metrics from the start
                    self.sessions.counts.setdefault(event, 0)
        self.metrics = RouterMetrics(self.pool, self.sessions)
        self.tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
        self._subscribers: dict[str, asyncio.Task] = {}
        # kv_pool value -> its view
        self._pool_views: dict[str, PoolView] = {}
        for spec in config.prefill:  # each takes requests once a health probe passed
            self.pool.add(spec, "prefill", probe_first=True)
        for spec in config.decode:
            self.pool.add(spec, "decode", probe_first=True)
        self.session: aiohttp.ClientSession | None = None
        self._models: set[str] = set()
        self._max_model_len: int | None = None
        self._key_block_size = config.block_size if self.scheduler.uses_prefix_index else None
        self.proxy: Proxy | None = None
        self.upkeep: PoolUpkeep | None = None
        self.admin = AdminApi(self, config.admin_token)
        # the edge: both read here, so --check-config and startup fail on a bad key file or cert
        self.api_keys = load_api_keys(config)
        self.tls = tls_context(config.tls_cert, config.tls_key) if config.tls_cert else None

    # -- lifecycle --------------------------------------------------------------------------
    async def startup(self, app: web.Application) -> None:
        self.session = new_session(self.config.timeouts.connect_s)
        self.pools = Pools(self.config.timeouts.connect_s)
        flow = self.profile.flow(self.config.transfer, self.config.push_head_start_s)
        spec = self.config.sessions
        if spec.redis_url is not None and self.sessions is not None:
            store = RedisSessionStore(spec.redis_url, spec.redis_prefix, spec.redis_timeout_s)
            index = self.prefix_index if self.scheduler.uses_prefix_index else None
            self.sharing = SessionSharing(self.sessions, store, spec, index, self.config.block_size)
            await self.sharing.start()
        self.proxy = Proxy(self.config, self.scheduler, self.ctx, flow, self.metrics, self.pools,
                           self.sessions, self.sharing)
        self.upkeep = PoolUpkeep(self.config, self.pool, self.session)
        for worker in self.pool:
            self._subscribe(worker)
        await self.upkeep.check_all()  # know health and models before the first request
        self.refresh_served()
        self.upkeep.on_change = self.refresh_served
        self.upkeep.start()
        log.info("pd-router ready on %s://%s:%d: %d prefill, %d decode (%s, %s)%s",
                 "https" if self.tls else "http", self.config.host, self.config.port,
                 len(self.pool.by_role("prefill")), len(self.pool.by_role("decode")),
                 self.config.engine, self.config.mode,
                 f"; {len(self.api_keys)} API key(s)" if self.api_keys else "")

    async def cleanup(self, app: web.Application) -> None:
        if self.upkeep:
            await self.upkeep.stop()
        if self.proxy is not None:
            await self.proxy.aclose()
        for view in self._pool_views.values():
            view.close()
        for task in self._subscribers.values():
            task.cancel()
        await asyncio.gather(*self._subscribers.values(), return_exceptions=True)
        if self.session:
            await self.session.close()
            await self.pools.close()
        if self.sharing is not None:
            await self.sharing.aclose()

    def _subscribe(self, worker: Worker) -> None:
        if worker.spec.kv_pool:
            name = worker.spec.kv_pool
            view = self._pool_views.get(name)
            if view is None:
                view = self._pool_views[name] = pool_view(name, worker.spec.kv_pool_group)
            self.prefix_index.attach_pool(worker.url, view)
        if worker.spec.kv_events and worker.url not in self._subscribers:
            sub = KvEventSubscriber(self.prefix_index, worker.url, worker.spec.kv_events,
                                    allow_any_host=worker.spec.kv_events_bind_any)
            self._subscribers[worker.url] = asyncio.create_task(sub.run())

    async def add_worker(self, spec: WorkerSpec, role: str) -> Worker:
        # Not routable until its probe passes: a worker that accepts connections but never
        # answers would otherwise hold requests for as long as the probe waits.
        worker = self.pool.add(spec, role, probe_first=True)
        self._subscribe(worker)
        if self.upkeep and not worker.probing:
            await self.upkeep.check(worker)
        self.refresh_served()
        return worker

    def remove_worker(self, url: str, role: str) -> Worker | None:
        worker = self.pool.remove(url, role)
        if worker is not None:
            task = self._subscribers.pop(worker.url, None)
            if task:
                task.cancel()
            self.prefix_index.forget_worker(worker.url)
            if self.sessions is not None and role == "decode":
                self.sessions.forget_worker(worker.url)
            self.refresh_served()
        return worker

    # -- serving ----------------------------------------------------------------------------
    def refresh_served(self) -> None:
        """Served models and context length, recomputed when workers change (not per request)."""
        if self.config.models:
            self._models = set(self.config.models)
        else:
            self._models = {m for w in self.pool if w.usable for m in w.models}
        lengths = [w.max_model_len for w in self.pool if w.usable and w.max_model_len]
        self._max_model_len = min(lengths) if lengths else None

    async def generate(self, http: web.Request) -> web.StreamResponse:
        path = http.path
        try:
            raw = await http.read()
            request = parse_request(
                raw, ENDPOINTS[path], http.headers, served_models=self._models,
                max_model_len=self._max_model_len, block_size=self._key_block_size,
                strip_transfer_fields=self.config.client_transfer_fields == "strip",
                tokenize=self.tokenizer)
        except BadRequest as bad:
            self.metrics.rejections.labels("bad_request").inc()
            return error_response(bad.status, bad.message, bad.param)
        except web.HTTPRequestEntityTooLarge:
            self.metrics.rejections.labels("too_large").inc()
            return error_response(413, f"request body exceeds {self.config.max_body_bytes} bytes")
        return await self.proxy.serve(http, request, path)

    async def models(self, http: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "owned_by": "pd-router", "max_model_len": self._max_model_len}
                for m in sorted(self._models)]
        return web.json_response({"object": "list", "data": data})

    async def health(self, http: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, http: web.Request) -> web.Response:
        """Counts for every probe; the workers (URLs, load) only with the admin token."""
        decodes = len(self.pool.usable("decode"))
        prefills = len(self.pool.usable("prefill"))
        body = {"ready": decodes > 0, "usable_decode": decodes, "usable_prefill": prefills}
        if self.admin.allows(http):
            body["workers"] = self.pool.snapshot()
        return web.json_response(body, status=200 if decodes > 0 else 503)

    async def prometheus(self, http: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    def app(self) -> web.Application:
        middlewares = ([api_key_middleware(self.api_keys, self.config.metrics_need_api_key)]
                       if self.api_keys else [])
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=middlewares)
        app.add_routes([web.post(path, self.generate) for path in ENDPOINTS])
        app.add_routes([web.get("/v1/models", self.models), web.get("/health", self.health),
                        web.get("/ready", self.ready), web.get("/metrics", self.prometheus)])
        app.add_routes(self.admin.routes())
        app.on_startup.append(self.startup)
        app.on_cleanup.append(self.cleanup)
        return app
