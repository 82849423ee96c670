"""Kubernetes discovery: the engine pods picked by a label selector become the router's workers.

List, then watch from the list's resourceVersion. A watch the server ends (its timeoutSeconds) is
resumed from the last resourceVersion seen, so no event is lost; `410 Gone` (that version is
compacted away) and any other API error mean a fresh list, reconciled against what the router
holds (new pods added, vanished ones removed). While the API is unreachable the workers last known
keep serving; retries back off up to `retry_max_s`, with one log line per outage.

A pod is added when it is Ready with an IP and not being deleted; the router probes it before it
gets traffic (probe_first), so a pod Kubernetes calls Ready that fails the router's own probe
gets none. It is removed (drained: requests it holds finish) when it is deleted, stops being
Ready or gets a deletionTimestamp; a pod whose address or ports change is removed and re-added.
A pod annotated kv-both whose `pd.role` label changes is moved to the other pool like the admin
API's role change (its requests of the old role finish first, then it takes the new role; the
same worker, probed and healthy). Without the annotation, or if the router refuses the move, the
relabelled pod is removed and added again as the new role (what its requests hold still finishes).
Past `max_pods` workers, further pods wait (up to max_pods of them, newest state kept) and are
added as held pods go; were even more dropped, the watch re-lists once room frees.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from lightkube import AsyncClient, operators
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Pod

from pd_plugins.routers.config import WorkerSpec
from pd_plugins.routers.discovery.pods import NotAWorker, PodWorker, pod_key, pod_name, pod_worker

log = logging.getLogger("pd_router.discovery")


class WorkerSink(Protocol):
    """What discovery changes: the Router (server.py) in service, a recorder in unit tests."""

    async def add_worker(self, spec: WorkerSpec, role: str, model: str | None = None) -> Any: ...

    def remove_worker(self, url: str, role: str, model: str | None = None) -> Any: ...

    async def move_worker(self, url: str, to: str, model: str | None = None,
                          drain_timeout_s: float = 60.0, spec: WorkerSpec | None = None) -> Any: ...


def _is_gone(exc: BaseException) -> bool:
    return isinstance(exc, ApiError) and exc.status is not None and exc.status.code == 410


class PodWatcher:
    def __init__(self, sink: WorkerSink, client: AsyncClient, namespace: str,
                 selector: list[tuple[str, operators.Operator]], models: dict[str, str] | None, *,
                 max_pods: int = 1000, watch_timeout_s: int = 300, retry_initial_s: float = 0.5,
                 retry_max_s: float = 10.0, role_drain_timeout_s: float = 60.0) -> None:
        self.sink, self.client, self.namespace = sink, client, namespace
        self.selector, self.models = selector, models
        self.max_pods = max_pods
        self.watch_timeout_s = watch_timeout_s
        # a watch silent this long (a half-open connection: no RST ever comes) is started again
        self.idle_limit_s = watch_timeout_s + 30.0
        self.retry_initial_s, self.retry_max_s = retry_initial_s, retry_max_s
        self.role_drain_timeout_s = role_drain_timeout_s
        self.pods: dict[str, PodWorker] = {}     # pod UID -> the worker it is now
        self.resource_version: str | None = None  # None: list before watching
        self.synced = asyncio.Event()            # the first list is applied
        self.counts = {"lists": 0, "watches": 0, "gone": 0, "api_errors": 0, "events": 0}
        self._adding: dict[tuple, asyncio.Task] = {}  # worker key -> its add (probe) in flight
        self._moving: dict[tuple, PodWorker] = {}  # worker key -> what it was, while it moves
        self._ignored: dict[str, str] = {}       # pod UID -> why it is no worker (logged once)
        # past max_pods: pods that would be workers, added as room frees (at most max_pods)
        self._waiting: dict[str, PodWorker] = {}
        self._dropped = False  # some did not fit even there: re-list once room frees
        self._relist = False   # the watch ends and run() lists again
        self._over_limit_logged = False
        self._outage_since: float | None = None
        self._gone_streak = 0  # 410s with no event between them
        self._task: asyncio.Task | None = None

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def api_up(self) -> bool:
        return self._outage_since is None

    def collector(self) -> "DiscoveryCollector":
        return DiscoveryCollector(self)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="pd-router kubernetes discovery")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._adding.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.close()

    async def run(self) -> None:
        delay = self.retry_initial_s
        while True:
            try:
                if self.resource_version is None:
                    await self._list()
                    if not self._gone_streak:
                        delay = self.retry_initial_s
                    self._recovered()
                await self._watch()  # returns when the watch went silent too long: watch again
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every API failure: keep workers, retry
                self.resource_version = None  # the next round lists and reconciles
                if _is_gone(exc):
                    self.counts["gone"] += 1
                    self._gone_streak += 1
                    log.info("kubernetes: watch history compacted (410 Gone): listing pods again")
                    if self._gone_streak > 1:  # Gone again right after a list: do not spin
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, self.retry_max_s)
                    continue
                self.counts["api_errors"] += 1
                if self._outage_since is None:
                    self._outage_since = asyncio.get_running_loop().time()
                    log.warning("kubernetes API unusable (%s: %s): keeping the %d known worker "
                                "pod(s), retrying up to every %.0f s", type(exc).__name__, exc,
                                len(self.pods), self.retry_max_s)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)

    def _recovered(self) -> None:
        if self._outage_since is not None:
            down = asyncio.get_running_loop().time() - self._outage_since
            log.info("kubernetes API back after %.1f s: %d worker pod(s)", down, len(self.pods))
            self._outage_since = None

    # -- list and watch -------------------------------------------------------------------
    async def _list(self) -> None:
        listing = self.client.list(Pod, namespace=self.namespace, labels=self.selector)
        wanted: dict[str, PodWorker | None] = {}
        async for pod in listing:
            wanted[pod_key(pod)] = self._worker_of(pod)
        self.counts["lists"] += 1
        self._waiting.clear()  # the list is the whole truth: what waits is found again below
        self._dropped = self._relist = False
        # removals first: a vanished pod's IP may already belong to a new one
        for key in [k for k in self.pods if k not in wanted]:
            await self._set(key, None, "gone from the list")
        for key in [k for k in self._ignored if k not in wanted]:
            del self._ignored[key]
        for key, worker in wanted.items():
            await self._set(key, worker, "changed")
        self.resource_version = listing.resourceVersion
        self.synced.set()

    async def _watch(self) -> None:
        if self._relist:  # room freed while listing, for pods dropped past the waiting bound
            self.resource_version = None
            return
        self.counts["watches"] += 1
        events = self.client.watch(Pod, namespace=self.namespace, labels=self.selector,
                                   resource_version=self.resource_version,
                                   server_timeout=self.watch_timeout_s).__aiter__()
        try:
            while True:
                try:  # not wait_for: on Python 3.11 it can swallow the cancel that stops us
                    async with asyncio.timeout(self.idle_limit_s):
                        kind, pod = await events.__anext__()
                except TimeoutError:
                    return
                self.counts["events"] += 1
                self._gone_streak = 0
                if pod.metadata is not None and pod.metadata.resourceVersion:
                    self.resource_version = pod.metadata.resourceVersion
                if kind == "BOOKMARK":
                    continue
                self._recovered()
                key = pod_key(pod)
                if kind == "DELETED":
                    self._ignored.pop(key, None)
                    await self._set(key, None, "deleted")
                else:
                    await self._set(key, self._worker_of(pod), "changed")
                if self._relist:  # room freed for pods dropped past the waiting bound
                    self.resource_version = None
                    return
        finally:
            await events.aclose()

    # -- pods -> workers ------------------------------------------------------------------
    def _worker_of(self, pod) -> PodWorker | None:
        key = pod_key(pod)
        try:
            worker = pod_worker(pod, self.models)
        except (NotAWorker, ValueError, TypeError) as why:  # whatever a pod's labels hold: that
            # pod is ignored, discovery goes on
            if self._ignored.get(key) != str(why) and len(self._ignored) < self.max_pods:
                self._ignored[key] = str(why)
                log.warning("kubernetes: pod %s ignored: %s", pod_name(pod), why)
            return None
        self._ignored.pop(key, None)
        if worker is None and key in self.pods:
            log.info("kubernetes: pod %s no longer Ready (or being deleted)", pod_name(pod))
        return worker

    async def _set(self, key: str, worker: PodWorker | None, why: str) -> None:
        self._waiting.pop(key, None)  # its newest state decides again below
        old = self.pods.get(key)
        if worker is not None and worker.same_as(old):
            return
        if (worker is not None and worker.role_change_of(old) and worker.spec.kv_both
                and old.key not in self._adding and worker.key not in self._adding):
            self.pods[key] = worker  # the same engine relabelled: drain, then the other pool
            self._moving[worker.key] = old
            self._adding[worker.key] = asyncio.create_task(self._move(old, worker))
            return
        if old is not None:
            del self.pods[key]
            await self._retire(old, why)
        if worker is None:
            if old is not None:
                await self._admit_waiting()
            return
        if len(self.pods) >= self.max_pods:
            if len(self._waiting) < self.max_pods:
                self._waiting[key] = worker
            else:
                self._dropped = True
            if not self._over_limit_logged:
                self._over_limit_logged = True
                log.warning("kubernetes: more than %d worker pods; the rest wait until held "
                            "ones go (discovery.max_pods)", self.max_pods)
            return
        self._over_limit_logged = False
        self.pods[key] = worker
        if worker.key not in self._adding:
            self._adding[worker.key] = asyncio.create_task(self._add(worker))

    async def _admit_waiting(self) -> None:
        """A held pod went: pods waiting past max_pods take its place, oldest first."""
        while self._waiting and len(self.pods) < self.max_pods:
            key = next(iter(self._waiting))
            await self._set(key, self._waiting[key], "room freed under discovery.max_pods")
        if self._dropped and len(self.pods) < self.max_pods:
            self._relist = True

    async def _add(self, worker: PodWorker) -> None:
        try:
            # the router probes it: no traffic until its own probe passes
            await self.sink.add_worker(worker.spec, worker.role, worker.model)
            log.info("kubernetes: %s worker %s added%s", worker.role, worker.spec.url,
                     f" (model {worker.model})" if worker.model else "")
        except Exception as exc:  # noqa: BLE001 - one bad pod must not stop discovery
            log.warning("kubernetes: could not add %s worker %s: %s", worker.role,
                        worker.spec.url, exc)
        finally:
            if self._adding.get(worker.key) is asyncio.current_task():
                del self._adding[worker.key]

    async def _move(self, old: PodWorker, worker: PodWorker) -> None:
        try:
            await self.sink.move_worker(worker.spec.url, worker.role, worker.model,
                                        drain_timeout_s=self.role_drain_timeout_s, spec=worker.spec)
            log.info("kubernetes: worker %s moved from %s to %s (pd.role changed)",
                     worker.spec.url, old.role, worker.role)
        except Exception as exc:  # noqa: BLE001 - refused (e.g. SGLang, already moving): re-add
            log.warning("kubernetes: worker %s could not move from %s to %s (%s): removing it "
                        "and adding it again as %s", worker.spec.url, old.role, worker.role, exc,
                        worker.role)
            self.sink.remove_worker(old.spec.url, old.role, old.model)
            await self._add(worker)
        finally:  # (_add, the fallback, may have dropped the entry already)
            if self._adding.get(worker.key) in (asyncio.current_task(), None):
                self._adding.pop(worker.key, None)
                self._moving.pop(worker.key, None)

    async def _retire(self, worker: PodWorker, why: str) -> None:
        if any(other.key == worker.key for other in self.pods.values()):
            return  # another pod stands for the same worker (an IP reused before an event came)
        adding = self._adding.pop(worker.key, None)
        moved_from = self._moving.pop(worker.key, None)
        if adding is not None:
            adding.cancel()
            await asyncio.gather(adding, return_exceptions=True)
        if moved_from is not None:  # a move cut short leaves the worker in its old role
            self.sink.remove_worker(moved_from.spec.url, moved_from.role, moved_from.model)
        removed = self.sink.remove_worker(worker.spec.url, worker.role, worker.model)
        role = worker.role
        if removed is None:
            # moved since through the admin API (POST /admin/workers/role): the engine is gone
            # from the other role, unless another pod of ours stands for it there (an IP reused)
            role = "decode" if worker.role == "prefill" else "prefill"
            if not any(other.key == (worker.spec.url, role, worker.model)
                       for other in self.pods.values()):
                removed = self.sink.remove_worker(worker.spec.url, role, worker.model)
        if removed is not None:
            log.info("kubernetes: %s worker %s removed (%s)", role, worker.spec.url, why)


class DiscoveryCollector:
    """/metrics: what discovery did (lists, watches, 410s, API errors, events), whether the API
    answers now, and how many pods it holds as workers."""

    def __init__(self, watcher: PodWatcher) -> None:
        self.watcher = watcher

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        watcher = self.watcher
        events = CounterMetricFamily("pd_router_discovery_events", "Kubernetes discovery: lists, "
                                     "watches, 410 Gone, API errors, pod events", labels=["event"])
        for event, count in watcher.counts.items():
            events.add_metric([event], count)
        yield events
        yield GaugeMetricFamily("pd_router_discovery_api_up", "1 unless the Kubernetes API is "
                                "unreachable now (the last known workers keep serving)",
                                value=1.0 if watcher.api_up else 0.0)
        yield GaugeMetricFamily("pd_router_discovery_pods", "Pods discovery holds as workers",
                                value=len(watcher.pods))
        yield GaugeMetricFamily("pd_router_discovery_pods_waiting", "Worker pods past "
                                "discovery.max_pods, added as held ones go",
                                value=len(watcher._waiting))

