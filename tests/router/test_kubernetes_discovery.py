"""Kubernetes discovery end to end: a real pd-router process (`--discovery kubernetes`) watching the
FAKE Kubernetes API server (pd_plugins/testing/fake_kube_api.py, in this test process, on
loopback; no cluster can run here) whose pods point at pd-mock-engine processes.

Every pod here has IP 127.0.0.1 and its mock's port as `pd-plugins.io/http-port`. What the router
does is read from the router itself: /admin/workers (with the token), /ready, and which mock the
requests reach. Each wait has a stated bound (BOUND_S: the router sees an event, probes the new
worker and routes to it, with 0.5 s health ticks)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterator

import requests

from pd_plugins.testing.engine_harness import start_all
from pd_plugins.testing.fake_kube_api import FakeKubeApi, make_pod, set_ready
from pd_plugins.testing.raw_client import sample
from pd_plugins.testing.router_harness import MockEngineProcess, RouterProcess
from tests.router.conftest import FAST_HEALTH, wait_until

TOKEN = "discovery-admin-token"
BOUND_S = 10.0  # pod event -> worker probed and routable (or gone); generous for a busy CI host
SPREAD = {"prefill": {"picker": {"name": "random"}}, "decode": {"picker": {"name": "random"}}}


def engine_pod(name: str, engine: MockEngineProcess, role: str = "decode", **kw) -> dict:
    return make_pod(name, role, "127.0.0.1", http_port=engine.port, **kw)


@contextlib.contextmanager
def discovering_router(tmp_path: Path, engines: list[MockEngineProcess], pods: list[dict]
                       ) -> Iterator[tuple[RouterProcess, FakeKubeApi]]:
    api = FakeKubeApi(namespace="engines")
    router = RouterProcess("router", args=(
        "--log-format", "text", "--discovery", "kubernetes", "--k8s-namespace", "engines",
        "--kubeconfig", str(tmp_path / "kubeconfig")),
        config={"health": FAST_HEALTH, "policy": SPREAD,
                "discovery": {"retry_max_s": 0.5, "watch_timeout_s": 60}},
        env={"PD_ROUTER_ADMIN_TOKEN": TOKEN})
    try:
        api.start()
        api.write_kubeconfig(tmp_path / "kubeconfig")
        for pod in pods:
            api.add_pod(pod)
        start_all(engines, timeout=60)
        router.start()
        router.wait_healthy(60)  # /ready: a discovered decode passed the router's probe
        yield router, api
    finally:
        for proc in [router, *engines]:
            proc.stop(grace=5)
        api.stop()


def workers(router: RouterProcess) -> dict[str, dict]:
    """URL -> the router's view of it, from the admin API."""
    resp = requests.get(router.url + "/admin/workers", timeout=10,
                        headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200, resp.text
    return {w["url"]: w for w in resp.json()["workers"]}


def healthy(router: RouterProcess) -> set[str]:
    return {url for url, w in workers(router).items() if w["healthy"]}


def send(router: RouterProcess, count: int) -> None:
    for _ in range(count):
        resp = requests.post(router.url + "/v1/completions", timeout=30,
                             json={"model": "mock", "prompt": "hello there", "max_tokens": 2})
        assert resp.status_code == 200, resp.text


def served(engine: MockEngineProcess) -> int:
    return engine.stats()["requests"]


def test_ready_pods_serve_after_the_probe_and_leave_when_deleted(tmp_path):
    good = MockEngineProcess("decode-good", role="decode")
    later = MockEngineProcess("decode-later", role="decode")
    sick = MockEngineProcess("decode-sick", role="decode", args=("--fail-rate", "1.0"))
    nothing = MockEngineProcess("never-started", role="decode")  # its port: nothing listens
    pods = [engine_pod("good", good), engine_pod("later", later, ready=False),
            engine_pod("sick", sick), engine_pod("nothing", nothing)]
    with discovering_router(tmp_path, [good, later, sick], pods) as (router, api):
        # Ready pods are workers; only those whose probe passed are routable; not Ready: absent
        wait_until(lambda: set(workers(router)) == {good.url, sick.url, nothing.url},
                   BOUND_S, "the three Ready pods as workers")
        assert healthy(router) == {good.url}
        send(router, 12)
        assert served(good) == 12 and served(sick) == 0 and served(later) == 0
        assert requests.get(router.url + "/ready", timeout=5).json()["usable_decode"] == 1

        # Ready later: a worker, probed, then given traffic
        api.update_pod("later", lambda p: set_ready(p, True))
        wait_until(lambda: later.url in healthy(router), BOUND_S, "the pod that became Ready")
        send(router, 30)
        assert served(later) > 0 and served(sick) == 0  # random picker: 2^-30 to miss `later`

        # deleted: drained and gone; every request after that lands on `later`
        api.delete_pod("good")
        wait_until(lambda: good.url not in workers(router), BOUND_S, "the deleted pod to leave")
        before = served(good)
        send(router, 10)
        assert served(good) == before

        # not Ready any more, or being deleted: out as well
        api.update_pod("sick", lambda p: p["metadata"].update(
            deletionTimestamp="2026-01-01T00:00:00Z"))
        api.update_pod("nothing", lambda p: set_ready(p, False))
        wait_until(lambda: set(workers(router)) == {later.url}, BOUND_S, "only `later` left")


def test_watch_expiry_gone_and_an_outage_keep_the_set_right(tmp_path):
    first = MockEngineProcess("decode-first", role="decode")
    second = MockEngineProcess("decode-second", role="decode")
    third = MockEngineProcess("decode-third", role="decode")
    fourth = MockEngineProcess("decode-fourth", role="decode")
    with discovering_router(tmp_path, [first, second, third, fourth],
                            [engine_pod("first", first)]) as (router, api):
        wait_until(lambda: api.count("watch") >= 1, BOUND_S, "the router's watch")
        assert api.count("list") == 1

        # the API ends the watch (its timeout): resumed from the last version, nothing missed
        api.expire_watches()
        api.add_pod(engine_pod("second", second))
        wait_until(lambda: healthy(router) == {first.url, second.url}, BOUND_S, "second")
        assert api.count("list") == 1 and api.count("watch") >= 2

        # events lost to compaction: the resumed watch gets 410 Gone, the router lists again
        api.quietly(lambda: (api.delete_pod("second"), api.add_pod(engine_pod("third", third))))
        api.compact()
        api.expire_watches()
        wait_until(lambda: set(workers(router)) == {first.url, third.url}, BOUND_S,
                   "the re-listed set")
        assert api.count("list") == 2

        # the API goes away: the known workers keep serving; changes made meanwhile arrive after
        api.start_outage("refuse")
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            send(router, 3)
        assert healthy(router) == {first.url, third.url}
        assert sample(router.metrics(), "pd_router_discovery_api_up") == 0
        assert sample(router.metrics(), "pd_router_discovery_events_total", event="gone") >= 1
        api.quietly(lambda: api.add_pod(engine_pod("fourth", fourth)))
        api.end_outage()
        wait_until(lambda: fourth.url in healthy(router), BOUND_S + 5, "recovery after the outage")
        before = served(fourth)
        send(router, 30)
        assert served(fourth) > before
        assert sample(router.metrics(), "pd_router_discovery_api_up") == 1
        assert sample(router.metrics(), "pd_router_discovery_pods") == 3
    log = router.log_path.read_text()
    assert log.count("kubernetes API unusable") == 1, "one warning per outage, not per retry"
    assert "kubernetes API back" in log
