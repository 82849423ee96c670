"""One model behind the router: its workers, what they hold, its policy, sessions and proxy.

A router serves one ModelGroup per `models:` entry (or one unnamed group, "", for a config
without `models:`). Groups share the router's HTTP clients, metrics, health upkeep and the views of
shared KV pools (keyed by kv_pool; the config refuses one pool in two models): each model's
workers, prefix index and latency models are its own, so one model's load or cache never counts
for another. `served` are the names a request's `model` may give to reach the
group: its configured name plus the LoRA adapters of that model its usable workers list in
/v1/models (the unnamed group: every name they list).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from pd_plugins.routers.config import ConfigError, ModelSpec, RouterConfig, WorkerSpec
from pd_plugins.routers.flows.profile import EngineProfile
from pd_plugins.routers.kv_sources.events import KvEventSubscriber
from pd_plugins.routers.kv_sources.pools import PoolView, pool_view
from pd_plugins.routers.metrics import RouterMetrics
from pd_plugins.routers.policy import PolicyContext, Scheduler
from pd_plugins.routers.policy.latency_model import LatencyModels
from pd_plugins.routers.policy.prefix_index import PrefixIndex
from pd_plugins.routers.proxy import Proxy
from pd_plugins.routers.request import Tokenize
from pd_plugins.routers.replica_channels import LatencyChannel, PinChannel, PrefixChannel, ReplicaShare
from pd_plugins.routers.replica_sync import ReplicaSync
from pd_plugins.routers.sessions import SessionTable
from pd_plugins.routers.upstream import Pools
from pd_plugins.routers.workers import Role, Worker, WorkerPool

log = logging.getLogger("pd_router")


class ModelNotFound(LookupError):
    """A model a caller named (admin API, discovery) that the router does not serve, or none
    named where several are served (a lookup, not a configuration problem); `status`: the HTTP
    answer (404 unknown, 400 missing)."""

    def __init__(self, message: str, status: int = 404) -> None:
        super().__init__(message)
        self.status = status


class MoveRefused(ConfigError):
    """A role change the router will not make; `status`: 404 unknown worker, 409 otherwise."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RoleMove:
    worker: Worker
    old: Role
    to: Role
    drained: int        # requests of the old role that finished while the move waited
    still_running: int  # past drain_timeout_s: requests of the old role still running there


DRAIN_POLL_S = 0.05  # how often a move looks at the worker's in-flight count
SUBSCRIBE_RETRY_S = (0.5, 30.0)  # a KV-event subscriber that ended: first and longest wait


class ModelGroup:
    def __init__(self, config: RouterConfig, spec: ModelSpec, profile: EngineProfile,
                 tokenizer: Callable[[str], Tokenize]) -> None:
        """`spec`: resolved (config.model_groups()); `tokenizer`: loads one by path (shared)."""
        self.config, self.spec, self.name, self.profile = config, spec, spec.name, profile
        for worker in spec.prefill:
            self.check(worker, "prefill")
        self.pool = WorkerPool(spec.name)
        self.prefix_index = PrefixIndex()
        self.latency = LatencyModels(config.latency)
        self.ctx = PolicyContext(self.pool, self.prefix_index, self.latency, spec.block_size)
        fixed = spec.decode[0].url if config.mode == "sidecar" else None
        self.scheduler = Scheduler(spec.policy, self.ctx, fixed_decode_url=fixed,
                                   local_prefill=profile.decode_prefills_locally)
        self.sessions = SessionTable(config.sessions) if self.scheduler.uses_sessions else None
        self.sharing: ReplicaShare | None = None  # with other router replicas (start)
        self.tokenize = tokenizer(spec.tokenizer) if spec.tokenizer else None
        # ModelTarget (request.py): what parse_request needs of the model a request named
        # (also when recording traffic: the record keeps them, for the simulator and the planner)
        self.key_block_size = (spec.block_size if self.scheduler.uses_prefix_index
                               or config.traffic_record else None)
        self.max_model_len: int | None = None
        self.served: frozenset[str] = frozenset([spec.name] if spec.name else [])
        self.adapter_parents: dict[str, str] = {}
        self.proxy: Proxy | None = None
        self._subscribers: dict[str, asyncio.Task] = {}
        for worker_spec in spec.prefill:  # each takes requests once a health probe passed
            self.pool.add(worker_spec, "prefill", probe_first=True)
        for worker_spec in spec.decode:
            self.pool.add(worker_spec, "decode", probe_first=True)

    # -- lifecycle (the router's event loop) -------------------------------------------------
    async def start(self, metrics: RouterMetrics, pools: Pools, views: dict[str, PoolView],
                    sync: ReplicaSync | None = None) -> None:
        flow = self.profile.flow(self.spec.transfer, self.config.push_head_start_s)
        if sync is not None:
            # each model's channels apart: one conversation id may exist in two models
            pins = (sync.add(PinChannel(self.sessions, sync.replica_id, self.name,
                                        known=self.has_decode))
                    if self.sessions is not None else None)
            prefixes = (sync.add(PrefixChannel(self.prefix_index, self.name, known=self.has_worker))
                        if self.scheduler.uses_prefix_index else None)
            sync.add(LatencyChannel(self.latency, self.name))
            self.sharing = ReplicaShare(pins, prefixes)
        self.proxy = Proxy(self.config, self.scheduler, self.ctx, flow, metrics, pools,
                           self.sessions, self.sharing, model=self.name)
        for worker in self.pool:
            self.subscribe(worker, views)

    async def stop(self) -> None:
        if self.proxy is not None:
            await self.proxy.aclose()
        for task in self._subscribers.values():
            task.cancel()
        await asyncio.gather(*self._subscribers.values(), return_exceptions=True)

    # -- workers --------------------------------------------------------------------------------
    def subscribe(self, worker: Worker, views: dict[str, PoolView]) -> None:
        """What the worker holds, into this model's prefix index: its shared pool, its KV events."""
        if worker.spec.kv_pool:
            name = worker.spec.kv_pool
            view = views.get(name)
            if view is None:
                view = views[name] = pool_view(name, worker.spec.kv_pool_group)
            self.prefix_index.attach_pool(worker.url, view)
        if worker.spec.kv_events and worker.url not in self._subscribers:
            sub = KvEventSubscriber(self.prefix_index, worker.url, worker.spec.kv_events,
                                    allow_any_host=worker.spec.kv_events_bind_any,
                                    replay=worker.spec.kv_events_replay)
            self._subscribers[worker.url] = asyncio.create_task(self._keep_subscribed(sub))

    async def _keep_subscribed(self, sub: KvEventSubscriber) -> None:
        """Run a worker's KV-event subscriber while the worker is in this model's pool (removing
        it cancels this): one that ends (a bind refused, a socket error) is logged and started
        again, backing off. Ended for good, the worker's cache would go unseen until a restart."""
        loop = asyncio.get_running_loop()
        delay = SUBSCRIBE_RETRY_S[0]
        while True:
            started = loop.time()
            try:
                await sub.run()
                why = "it ended"
            except Exception as exc:  # noqa: BLE001 - logged; started again below
                why = f"{type(exc).__name__}: {exc}"
            if not self.has_worker(sub.worker_url):
                return
            if loop.time() - started > SUBSCRIBE_RETRY_S[1]:  # it had run a while: wait little
                delay = SUBSCRIBE_RETRY_S[0]
            log.warning("KV events of %s stopped (%s): subscribing again in %.1f s",
                        sub.worker_url, why, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, SUBSCRIBE_RETRY_S[1])

    def check(self, spec: WorkerSpec, role: Role) -> None:
        """Refuse a worker this engine cannot run in this model's transfer mode (at startup, and
        for workers added while serving: admin API, discovery). flows/<engine>.py says what."""
        problem = self.profile.prefill_problem(spec, self.spec.transfer) if role == "prefill" else None
        if problem is not None:
            where = f"model {self.name!r}: " if self.name else ""
            raise ConfigError(f"{where}{role} {spec.url}: {problem}")

    def add(self, spec: WorkerSpec, role: Role) -> Worker:
        self.check(spec, role)
        # Not routable until its probe passes: a worker that accepts connections but never
        # answers would otherwise hold requests for as long as the probe waits.
        return self.pool.add(spec, role, probe_first=True)

    def has_decode(self, url: str) -> bool:
        return self.pool.get(url, "decode") is not None

    def has_worker(self, url: str) -> bool:
        return self.pool.get(url, "prefill") is not None or self.pool.get(url, "decode") is not None

    def remove(self, url: str, role: Role) -> Worker | None:
        """Stop routing to the worker (requests it holds finish) and forget what it held."""
        worker = self.pool.remove(url, role)
        if worker is not None:
            if not self.has_worker(worker.url):  # a kv_both engine may still hold the other role:
                task = self._subscribers.pop(worker.url, None)  # its events, pool and prefixes
                if task:                                         # are that one's too
                    task.cancel()
                self.prefix_index.forget_worker(worker.url)
            if self.sessions is not None and role == "decode":
                self.sessions.forget_worker(worker.url)
        return worker

    async def move_worker(self, url: str, to: Role, drain_timeout_s: float,
                          spec: WorkerSpec | None = None) -> RoleMove:
        """Move a kv_both worker to the other pool: it takes no new requests of its old role at
        once, the router waits (at most `drain_timeout_s`) for the ones it holds, then it serves
        `to`. The same Worker moves, so its health, probes and load carry over (one engine).
        `spec`: its spec from now on (discovery: the pod as relabelled). MoveRefused if it cannot.

        What it holds stays in the prefix index: the engine's cache does not change with the
        router's view of its role, and a prefill that becomes a decode (or back) still skips
        the cached blocks. Sessions pinned to a decode that becomes a prefill re-pin on their next
        turn; the prefix scorer then still sends their prefill to the engine holding them."""
        old: Role = "decode" if to == "prefill" else "prefill"
        worker = self.pool.get(url, old)
        if worker is None:
            if self.pool.get(url, to) is not None:
                raise MoveRefused(f"{url} is already a {to} worker", 409)
            raise MoveRefused(f"no worker {url}" + (f" of model {self.name}" if self.name else ""), 404)
        if self.pool.get(url, to) is not None:  # the engine is in both pools already
            raise MoveRefused(f"{url} is already a {to} worker", 409)
        spec = spec or worker.spec
        if worker.moving_to is not None:
            raise MoveRefused(f"{url} is already moving to {worker.moving_to}", 409)
        if not spec.kv_both:
            raise MoveRefused(f"{url} is not declared kv_both (the worker option kv_both=true: "
                              f"an engine started with kv_role kv_both)", 409)
        if self.config.mode == "sidecar":
            raise MoveRefused("a sidecar router's decode is fixed: no role changes", 409)
        if not self.profile.decode_prefills_locally:  # SGLang: a disaggregation mode per process
            raise MoveRefused(f"{self.profile.name} workers cannot change role while running", 409)
        try:
            self.check(spec, to)
        except ConfigError as problem:
            raise MoveRefused(str(problem), 409) from None
        if old == "decode" and not any(w is not worker and w.moving_to is None and w.healthy
                                       for w in self.pool.by_role("decode")):
            # every request needs a decode; an empty prefill pool is fine (decodes prefill locally)
            of_model = f" of model {self.name}" if self.name else ""
            raise MoveRefused(f"{url} is the last healthy decode worker{of_model}: the router would "
                              f"have nowhere to decode; add or move in another first", 409)
        worker.moving_to, worker.draining = to, True  # no new requests of the old role from now
        try:
            # this replica's requests only: other replicas' load (added to in_flight) is theirs
            # to finish, and they do not know of the move (they keep sending to the worker)
            holding = worker.own_in_flight
            loop = asyncio.get_running_loop()
            deadline = loop.time() + drain_timeout_s
            while worker.own_in_flight > 0 and loop.time() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
            if self.pool.get(url, old) is not worker:
                raise MoveRefused(f"{url} was removed while moving", 409)
            still_running = max(0, worker.own_in_flight)
            self.pool.move(worker, to)
            worker.spec = spec
            if old == "decode" and self.sessions is not None:
                self.sessions.forget_worker(url)
            return RoleMove(worker, old, to, max(0, holding - still_running), still_running)
        finally:
            if worker.moving_to == to:  # moved, refused or cancelled: serving one role again
                worker.moving_to = None
                if self.pool.get(url, worker.role) is worker:
                    worker.draining = False

    # -- what it serves ---------------------------------------------------------------------------
    def refresh(self, others: frozenset[str] = frozenset()) -> None:
        """Served names, adapters and context length from the usable workers (when they change).
        `others`: the other models' configured names (a router with `models:`)."""
        usable = [w for w in self.pool if w.usable]
        if self.name:
            # a named model serves its name and its own adapters: a worker only has to list the
            # model's name, and whatever else it lists must not capture another model's names
            names = {self.name}
            parents = {w: self._adapters(w, others) for w in self.pool}
        else:  # the unnamed model: every name its workers list
            names = {m for w in usable for m in w.models}
            parents = {w: w.adapter_parents for w in self.pool}
        names.update(a for w in usable for a in parents[w])
        # an adapter stays known while the workers that listed it are down, so a request for it
        # gets 503 (the scheduler finds no usable worker with it), not 404
        self.adapter_parents = {a: p for w in self.pool for a, p in parents[w].items()}
        self.served = frozenset(names | self.adapter_parents.keys())
        lengths = [w.max_model_len for w in usable if w.max_model_len]
        self.max_model_len = min(lengths) if lengths else None

    def _adapters(self, worker: Worker, others: frozenset[str]) -> dict[str, str]:
        """The worker's adapters of this model: `parent` is its name, or another base name the
        worker lists (vLLM names an adapter's parent by the first --served-model-name), but
        none of another model's names."""
        bases = {m for m in worker.models if m not in worker.adapter_parents} - others
        bases.add(self.name)
        return {a: p for a, p in worker.adapter_parents.items()
                if p in bases and a not in others and a != self.name}

    def usable_counts(self) -> dict[str, int]:
        return {"usable_decode": len(self.pool.usable("decode")),
                "usable_prefill": len(self.pool.usable("prefill"))}

    def __repr__(self) -> str:
        return f"ModelGroup({self.name or '<unnamed>'})"
