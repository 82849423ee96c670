"""A FAKE Kubernetes API server: just enough of /api/v1 pods for the router's discovery tests.

Not Kubernetes: no real cluster can run here, so this speaks the part of the API that a client
library uses to list and watch pods, and lets a test drive what a cluster would do:

- GET /api/v1/namespaces/{ns}/pods: a PodList (labelSelector honoured, metadata.resourceVersion);
- the same with ?watch=1: newline-delimited JSON events (ADDED, MODIFIED, DELETED) from
  `resourceVersion` on, ended after `timeoutSeconds`; a version older than the kept history gets
  the API's answer, an ERROR event with a Status of code 410 (Gone);
- controls: add, change and delete pods; expire every open watch; compact the history (the next
  watch from an old version gets 410); an outage (connections refused, or 500s) and its end.

It runs in a thread of the test process (`FakeKubeApi.start()`), on loopback, with a bearer
token that every request must carry (`write_kubeconfig` gives a client both).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import re
import threading
import uuid
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from pd_plugins.testing.processes import free_port

MAX_HISTORY = 10_000  # events kept for watches that resume; older ones are compacted away
MAX_WATCH_QUEUE = 10_000


def make_pod(name: str, role: str, ip: str | None = "127.0.0.1", *, ready: bool = True,
             model: str | None = None, http_port: int | None = None,
             annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None,
             part_of: str = "pd-plugins") -> dict[str, Any]:
    """A pod as the API returns it, with the pd-plugins labels and annotations."""
    all_labels = {"app.kubernetes.io/part-of": part_of, "pd.role": role, **(labels or {})}
    if model is not None:
        all_labels["pd.model"] = model
    notes = dict(annotations or {})
    if http_port is not None:
        notes["pd-plugins.io/http-port"] = str(http_port)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "labels": all_labels, "annotations": notes},
           "spec": {"containers": [{"name": "engine", "image": "pd-plugins:test"}]},
           "status": {"phase": "Running"}}
    set_ready(pod, ready)
    if ip is not None:
        pod["status"]["podIP"] = ip
    return pod


def set_ready(pod: dict, ready: bool) -> dict:
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    return pod


def _selector_terms(text: str) -> list[str]:
    terms, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(text[start:i].strip())
            start = i + 1
    terms.append(text[start:].strip())
    return [t for t in terms if t]


def selector_matches(selector: str | None, labels: dict[str, str]) -> bool:
    """The API server's label selector semantics, for the forms a client sends."""
    for term in _selector_terms(selector or ""):
        if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term):
            values = {v.strip() for v in m[3].split(",")}
            if (labels.get(m[1]) in values) != (m[2] == "in"):
                return False
        elif m := re.fullmatch(r"([^!=\s]+)\s*(!=|==|=)\s*(\S*)", term):
            equal = labels.get(m[1]) == m[3]
            if equal == (m[2] == "!="):
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


class FakeKubeApi:
    """The fake API server. Control methods may be called from the test's thread."""

    def __init__(self, namespace: str = "default", token: str = "fake-kube-token") -> None:
        self.namespace, self.token = namespace, token
        self.port = free_port()
        self.pods: dict[tuple[str, str], dict] = {}  # (namespace, name) -> pod
        self.version = 100                             # the last resourceVersion handed out
        self.history: collections.deque = collections.deque(maxlen=MAX_HISTORY)
        self.oldest_kept = self.version  # a watch from a version older than this gets 410
        self.outage: str | None = None   # None, "refuse" (nothing listens) or "error" (500s)
        self.requests: collections.deque = collections.deque(maxlen=1000)  # (kind, params)
        self._watches: set[asyncio.Queue] = set()
        self._quiet = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- running ---------------------------------------------------------------------------
    def start(self) -> FakeKubeApi:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True,
                                        name="fake-kube-api")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fake Kubernetes API did not start in 10 s")
        return self

    def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(self._listen())
        ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    async def _listen(self) -> None:
        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await self._site.start()

    def stop(self) -> None:
        if self._loop is None or not self._thread:
            return
        self._call(self._end_watches)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> FakeKubeApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, fn, *args) -> Any:
        """Run fn on the server's loop and wait for it (controls come from the test thread)."""
        async def call():
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(10)

    def write_kubeconfig(self, path: Path, namespace: str | None = None) -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                      "namespace": namespace or self.namespace}}],
        }))
        return path

    # -- controls ----------------------------------------------------------------------------
    def add_pod(self, pod: dict, namespace: str | None = None) -> dict:
        return self._call(self._change, "ADDED", copy.deepcopy(pod), namespace or self.namespace)

    def update_pod(self, name: str, change, namespace: str | None = None) -> dict:
        """`change(pod)` edits a copy of the pod in place; the result is a MODIFIED event."""
        ns = namespace or self.namespace
        pod = copy.deepcopy(self.pods[(ns, name)])
        change(pod)
        return self._call(self._change, "MODIFIED", pod, ns)

    def delete_pod(self, name: str, namespace: str | None = None) -> dict:
        ns = namespace or self.namespace
        return self._call(self._change, "DELETED", copy.deepcopy(self.pods[(ns, name)]), ns)

    def quietly(self, changes) -> None:
        """Run `changes()` (control calls) without telling the open watches: events a watcher
        misses, as across a compaction or an outage."""
        self._quiet = True
        try:
            changes()
        finally:
            self._quiet = False

    def expire_watches(self) -> int:
        """End every open watch cleanly, as the API does at its timeout."""
        return self._call(self._end_watches)

    def compact(self) -> None:
        """Forget the event history: a watch from any version before now gets 410 Gone."""
        def forget():
            self.history.clear()
            self.oldest_kept = self.version
        self._call(forget)

    def start_outage(self, mode: str = "refuse") -> None:
        """`refuse`: stop listening (connections refused); `error`: answer 500. Open watches end."""
        assert mode in ("refuse", "error")
        async def go_down():
            self.outage = mode
            self._end_watches()
            if mode == "refuse":
                await self._site.stop()
        self._call(go_down)

    def end_outage(self) -> None:
        async def come_back():
            if self.outage == "refuse":
                await self._listen()
            self.outage = None
        self._call(come_back)

    def count(self, kind: str) -> int:
        with self._lock:
            return sum(1 for k, _ in self.requests if k == kind)

    # -- the API -------------------------------------------------------------------------------
    def _change(self, kind: str, pod: dict, namespace: str) -> dict:
        self.version += 1
        meta = pod["metadata"]
        meta["namespace"] = namespace
        meta["resourceVersion"] = str(self.version)
        key = (namespace, meta["name"])
        if kind == "ADDED":
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
            self.pods[key] = pod
        elif kind == "DELETED":
            self.pods.pop(key, None)
        else:
            self.pods[key] = pod
        event = (self.version, kind, copy.deepcopy(pod))
        if len(self.history) == self.history.maxlen:
            self.oldest_kept = self.history[0][0]
        self.history.append(event)
        for queue in [] if self._quiet else list(self._watches):
            if queue.qsize() < MAX_WATCH_QUEUE:
                queue.put_nowait(event)
        return copy.deepcopy(pod)

    def _end_watches(self) -> int:
        for queue in self._watches:
            queue.put_nowait(None)
        return len(self._watches)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info["namespace"]
        params = request.query
        watch = params.get("watch") in ("1", "true")
        with self._lock:
            self.requests.append(("watch" if watch else "list", dict(params)))
        if self.outage == "error":
            return web.json_response(_status(500, "InternalError", "fake outage"), status=500)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        selector = params.get("labelSelector")
        matching = [p for (ns, _), p in self.pods.items()
                    if ns == namespace and selector_matches(selector, p["metadata"]["labels"])]
        if not watch:
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.version)},
                                      "items": matching})
        return await self._watch(request, namespace, selector, matching)

    async def _watch(self, request: web.Request, namespace: str, selector: str | None,
                     current: list[dict]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        since = request.query.get("resourceVersion")
        queue: asyncio.Queue = asyncio.Queue()
        self._watches.add(queue)  # before the replay: nothing happens between (one loop)

        async def send(kind: str, obj: dict) -> None:
            await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        try:
            if since in (None, "", "0"):  # the API's "any version": the current pods as ADDED
                for pod in current:
                    await send("ADDED", pod)
            elif int(since) < self.oldest_kept:
                await send("ERROR", _status(410, "Expired",
                                            f"too old resource version: {since} ({self.oldest_kept})"))
                return resp
            else:
                for version, kind, pod in list(self.history):
                    if version > int(since) and self._visible(pod, namespace, selector):
                        await send(kind, pod)
            timeout = float(request.query.get("timeoutSeconds") or 1800)
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    event = await asyncio.wait_for(queue.get(), left)
                except asyncio.TimeoutError:
                    break
                if event is None:  # expired or an outage
                    break
                version, kind, pod = event
                if since not in (None, "", "0") and version <= int(since):
                    continue
                if self._visible(pod, namespace, selector):
                    await send(kind, pod)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watches.discard(queue)
        try:
            if self.outage is None:
                await resp.write_eof()
            elif request.transport is not None:  # an outage cuts the connection instead
                request.transport.close()
        except ConnectionResetError:  # the client went first
            pass
        return resp

    @staticmethod
    def _visible(pod: dict, namespace: str, selector: str | None) -> bool:
        meta = pod["metadata"]
        return meta.get("namespace") == namespace and selector_matches(selector, meta["labels"])
