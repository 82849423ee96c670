"""A router replica that starts with Kubernetes discovery and `sessions.redis_url` adopts the pins
its peers published before it started: a real pd-router process (`--discovery kubernetes`) against
the FAKE Kubernetes API (pd_plugins/testing/fake_kube_api.py) whose pods are two pd-mock-engine
decodes, and a real redis-server holding a peer replica's pin (written from this test process with
ReplicaSync + PinChannel, on the router's stream key).

A pin is adopted only for a decode worker the pool knows (model_group.py, known=has_decode), and
pins are republished only when they change: a sync that read the stream's history before
discovery listed the pods refused every pin in it, for good (each rolling restart of deploy/'s
two replicas lost conversation affinity). The router starts its sync after discovery's first list.
"""

from __future__ import annotations

import asyncio
import re

import pytest
import requests

from pd_plugins.routers.config import SessionSpec
from pd_plugins.routers.policy.base import RequestInfo
from pd_plugins.routers.replica_channels import PinChannel
from pd_plugins.routers.replica_sync import RedisLog, ReplicaSync
from pd_plugins.routers.sessions import SessionTable
from pd_plugins.testing.engine_harness import start_all
from pd_plugins.testing.fake_kube_api import FakeKubeApi
from pd_plugins.testing.kv_servers import REDIS_SERVER
from pd_plugins.testing.router_harness import MockEngineProcess, RouterProcess
from tests.router.conftest import FAST_HEALTH, wait_until
from tests.router.test_kubernetes_discovery import TOKEN, engine_pod, healthy
from tests.router.test_replica_sync import redis_server  # noqa: F401 - the fixture
from tests.router.test_session_store import MULTI_TURN

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed "
                                "(apt-get install redis-server): replica tests skipped")

PREFIX = "disc-pins:"
SESSION = "conversation-s"
BOUND_S = 15.0  # router started -> the pin applied (discovery's list, then the stream's history)


def publish_pin(redis_url: str, decode_url: str) -> None:
    """As a peer replica does after a turn of SESSION on `decode_url` (the unnamed model's pins)."""
    async def run():
        table = SessionTable(SessionSpec())
        sync = ReplicaSync(RedisLog(redis_url, PREFIX + "replicas", timeout_s=1.0, stream_len=1000,
                                    ttl_s=3600), replica_id="peer", interval_s=0.02)
        pins = sync.add(PinChannel(table, "peer", ""))
        info = RequestInfo(session_id=SESSION, block_keys=[11, 12, 13], prompt_tokens=48)
        table.resolve(info)
        pins.recorded(table.record(info, decode_url))
        await sync.start()
        try:
            for _ in range(250):
                if sync.counts["published"]:
                    break
                await asyncio.sleep(0.02)
            assert sync.counts["published"] == 1, sync.counts
        finally:
            await sync.aclose()
    asyncio.run(run())


def event(router: RouterProcess, name: str) -> float:
    match = re.search(rf'^pd_router_session_events_total\{{event="{name}"\}} (\S+)$', router.metrics(), re.M)
    return float(match.group(1)) if match else 0.0


def test_pins_published_before_start_are_adopted_once_discovery_listed(tmp_path, redis_server):  # noqa: F811
    decodes = [MockEngineProcess(f"decode-{i}", role="decode") for i in range(2)]
    api = FakeKubeApi(namespace="engines")
    router = RouterProcess("router", args=(
        "--log-format", "text", "--discovery", "kubernetes", "--k8s-namespace", "engines",
        "--kubeconfig", str(tmp_path / "kubeconfig")),
        config={"health": FAST_HEALTH, "policy": MULTI_TURN, "route_header": "full",
                "discovery": {"retry_max_s": 0.5, "watch_timeout_s": 60},
                "sessions": {"redis_url": redis_server.redis_url, "redis_prefix": PREFIX,
                             "redis_timeout_s": 0.5}},
        env={"PD_ROUTER_ADMIN_TOKEN": TOKEN})
    try:
        api.start()
        api.write_kubeconfig(tmp_path / "kubeconfig")
        for i, engine in enumerate(decodes):
            api.add_pod(engine_pod(f"decode-{i}", engine))
        start_all(decodes, timeout=60)
        # the second pod's decode: not the one an idle pool's first pick would favour
        pinned = decodes[1]
        publish_pin(redis_server.redis_url, pinned.url)

        router.start()
        router.wait_healthy(60)
        wait_until(lambda: event(router, "replica_adopted") + event(router, "replica_refused") >= 1,
                   BOUND_S, "the peer's pin applied")
        assert (event(router, "replica_adopted"), event(router, "replica_refused")) == (1, 0)
        wait_until(lambda: healthy(router) == {d.url for d in decodes}, BOUND_S, "both decodes")

        for turn in range(3):
            resp = requests.post(router.url + "/v1/completions", timeout=30,
                                 headers={"X-Session-Id": SESSION},
                                 json={"model": "mock", "prompt": [1, 2, 3, 4 + turn], "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            route = resp.headers["x-pd-route"]
            assert f"decode={pinned.url}," in route, route
        assert pinned.stats()["requests"] == 3 and decodes[0].stats()["requests"] == 0
    finally:
        for proc in [router, *decodes]:
            proc.stop(grace=5)
        api.stop()
