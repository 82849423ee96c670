"""Role changes through the admin API (POST /admin/workers/role) with pd-mock-engine processes:
a kv_both worker moves between the decode and prefill pools while requests flow, the move waits
for the requests it holds in its old role, and the refusals say why."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import requests

from pd_plugins.testing.router_harness import MockEngineProcess
from tests.router.conftest import LONG_PROMPT, deployment, wait_until

pytestmark = pytest.mark.processes

TOKEN = "role-token"
ENV = {"PD_ROUTER_ADMIN_TOKEN": TOKEN}


@dataclass
class KvBothMock(MockEngineProcess):
    """A mock that serves both legs, declared kv_both to the router."""

    def worker_arg(self) -> list[str]:
        return [self.url, "kv_both=true"]


def move(router, url: str, to: str, token: str | None = TOKEN, timeout: float = 60, **more):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(router.url + "/admin/workers/role", json={"url": url, "to": to, **more},
                         headers=headers, timeout=timeout)


def roles(router) -> dict[str, str]:
    workers = requests.get(router.url + "/admin/workers", timeout=10,
                           headers={"Authorization": f"Bearer {TOKEN}"}).json()["workers"]
    return {w["url"]: w["role"] for w in workers}


def complete(router, max_tokens: int = 4) -> int:
    return requests.post(router.url + "/v1/completions", timeout=60, json={
        "model": "mock", "prompt": LONG_PROMPT, "max_tokens": max_tokens}).status_code


def test_moves_under_load_lose_no_request():
    """W (kv_both) starts as a decode, moves to prefill and back while four clients send:
    every request sent succeeds, and W served each role in its turn."""
    prefill = MockEngineProcess("prefill0", role="prefill", args=("--tpot-ms", "10"))
    decode = MockEngineProcess("decode0", role="decode", args=("--tpot-ms", "10"))
    both = KvBothMock("both0", role="both", args=("--tpot-ms", "10"))
    with deployment([prefill], [decode, both], "--policy", "round_robin", env=ENV) as router:
        sent, statuses = [0], []
        stop = threading.Event()
        lock = threading.Lock()

        def load():
            while not stop.is_set():
                with lock:
                    sent[0] += 1
                try:
                    status = complete(router)
                except requests.RequestException as exc:  # counted as lost
                    status = repr(exc)
                with lock:
                    statuses.append(status)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: both.stats()["remote_decodes"] >= 5, what="W to decode")
            to_prefill = move(router, both.url, "prefill")
            assert to_prefill.status_code == 200, to_prefill.text
            assert to_prefill.json()["from"] == "decode" and to_prefill.json()["to"] == "prefill"
            assert to_prefill.json()["still_running"] == 0
            assert roles(router)[both.url] == "prefill"
            decodes_then = both.stats()["remote_decodes"]
            wait_until(lambda: both.stats()["prefill_legs"] >= 5, what="W to prefill")
            # a prefill takes no decode legs (all of W's decodes were done before the answer)
            assert both.stats()["remote_decodes"] == decodes_then
            to_decode = move(router, both.url, "decode")
            assert to_decode.status_code == 200, to_decode.text
            assert to_decode.json()["from"] == "prefill"
            prefills_then = both.stats()["prefill_legs"]
            wait_until(lambda: both.stats()["remote_decodes"] >= decodes_then + 5,
                       what="W to decode again")
            assert both.stats()["prefill_legs"] == prefills_then
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        # the three waits above need at least 15 requests through W; every one sent came back
        assert len(statuses) == sent[0] >= 15
        assert set(statuses) == {200}, [s for s in statuses if s != 200][:5]


def test_move_waits_for_requests_of_the_old_role():
    """A slow decode leg on W: the move answers after it finished (drained 1); with a short
    drain_timeout_s the move happens anyway and says one request still runs, which finishes.
    The last healthy decode worker never moves: the router would have nowhere to decode."""
    prefill = MockEngineProcess("prefill0", role="prefill")
    both = KvBothMock("both0", role="both", args=("--tpot-ms", "150"))
    other = KvBothMock("both1", role="both", args=("--tpot-ms", "150"))
    with deployment([prefill], [both, other], "--policy", "round_robin", env=ENV) as router:
        # 12 tokens at 150 ms: about 1.8 s on a worker; with the short drain_timeout_s, 30
        # (about 4.5 s): the leg outlasts a move slowed by a loaded machine
        for drain_timeout_s, expect_drained, tokens in ((30.0, 1, 12), (0.2, 0, 30)):
            if roles(router)[both.url] != "decode":
                assert move(router, both.url, "decode").status_code == 200
            result: list[int] = []
            clients: list[threading.Thread] = []
            for _ in range(6):  # round robin over two decodes: until a leg runs on W
                clients.append(threading.Thread(
                    target=lambda n=tokens: result.append(complete(router, n))))
                clients[-1].start()
                time.sleep(0.3)
                if both.stats()["running"]:
                    break
            wait_until(lambda: both.stats()["running"] >= 1, what="W's decode leg")
            client = clients[-1]
            started = time.monotonic()
            moved = move(router, both.url, "prefill", drain_timeout_s=drain_timeout_s)
            took = time.monotonic() - started
            assert moved.status_code == 200, moved.text
            body = moved.json()
            assert (body["drained"], body["still_running"]) == (expect_drained, 1 - expect_drained)
            if expect_drained:
                assert not client.is_alive() or both.stats()["running"] == 0
                assert took > 0.5  # it waited for the leg
            else:
                assert took < 3.0 and client.is_alive()  # it did not wait for the leg (4.5 s)
            for c in clients:
                c.join(timeout=30)
            assert result == [200] * len(clients)  # the requests of the old role finished normally
        last = move(router, other.url, "prefill")  # W is a prefill now: `other` is the last decode
        assert last.status_code == 409 and "last healthy decode" in last.json()["error"]["message"]
        assert roles(router)[other.url] == "decode"


def test_refusals_and_the_token():
    prefill = MockEngineProcess("prefill0", role="prefill")
    decode = MockEngineProcess("decode0", role="decode")
    both = KvBothMock("both0", role="both", args=("--tpot-ms", "300"))
    with deployment([prefill], [decode, both], "--policy", "round_robin", env=ENV) as router:
        assert move(router, both.url, "prefill", token=None).status_code == 401
        assert move(router, both.url, "prefill", token="wrong").status_code == 403
        bad = move(router, both.url, "router")
        assert bad.status_code == 400 and "prefill or decode" in bad.json()["error"]["message"]
        bad = move(router, both.url, "prefill", drain_timeout_s=-1)
        assert bad.status_code == 400 and "drain_timeout_s" in bad.json()["error"]["message"]
        unknown = move(router, "http://127.0.0.1:9", "prefill")
        assert unknown.status_code == 404 and "no worker" in unknown.json()["error"]["message"]
        fixed = move(router, decode.url, "prefill")  # not declared kv_both
        assert fixed.status_code == 409 and "kv_both" in fixed.json()["error"]["message"]
        same = move(router, both.url, "decode")
        assert same.status_code == 409 and "already a decode" in same.json()["error"]["message"]
        # two moves of one worker: the second is refused while the first drains a slow leg
        clients: list[threading.Thread] = []
        for _ in range(6):  # round robin: until a slow leg (10 tokens at 300 ms) runs on W
            clients.append(threading.Thread(target=complete, args=(router, 10)))
            clients[-1].start()
            time.sleep(0.3)
            if both.stats()["running"]:
                break
        assert both.stats()["running"] == 1
        first: list[requests.Response] = []
        mover = threading.Thread(target=lambda: first.append(move(router, both.url, "prefill")))
        mover.start()
        wait_until(lambda: roles(router)[both.url] == "decode" and _moving(router, both.url),
                   what="the first move to drain")
        second = move(router, both.url, "prefill")
        assert second.status_code == 409 and "already moving" in second.json()["error"]["message"]
        mover.join(timeout=30)
        for client in clients:
            client.join(timeout=30)
        assert first[0].status_code == 200 and first[0].json()["drained"] == 1
        assert roles(router) == {prefill.url: "prefill", decode.url: "decode", both.url: "prefill"}


def _moving(router, url: str) -> bool:
    workers = requests.get(router.url + "/admin/workers", timeout=10,
                           headers={"Authorization": f"Bearer {TOKEN}"}).json()["workers"]
    return any(w["url"] == url and w["moving_to"] for w in workers)


def test_relabelled_kubernetes_pod_moves_with_its_state(tmp_path):
    """Kubernetes discovery (a FAKE API server: no cluster runs here) with the real Router in
    this process: a kv-both pod whose pd.role label changes decode -> prefill -> decode is the
    same worker moved (its health carries over, no request lost); a pod without the annotation
    is removed and added again."""
    import asyncio

    import aiohttp
    import msgspec
    from aiohttp import web

    from pd_plugins.routers.config import config_from_mapping
    from pd_plugins.routers.policy import preset
    from pd_plugins.routers.server import Router
    from pd_plugins.testing.engine_harness import start_all
    from pd_plugins.testing.fake_kube_api import FakeKubeApi, make_pod
    from pd_plugins.testing.processes import free_port

    engines = {name: MockEngineProcess(name, role=role, args=("--tpot-ms", "10"))
               for name, role in (("p", "prefill"), ("d", "decode"), ("w", "both"))}

    def relabel(role):
        def change(pod):
            pod["metadata"]["labels"]["pd.role"] = role
        return change

    async def scenario(api: FakeKubeApi, router: Router, url: str) -> None:
        pool = router.groups[""].pool
        w_url = engines["w"].url

        async def until(predicate, what):
            deadline = time.monotonic() + 20
            while not predicate():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.02)

        await until(lambda: len([w for w in pool if w.usable]) == 3, "three usable workers")
        worker = pool.get(w_url, "decode")
        sent, statuses, stop = [0], [], asyncio.Event()

        async def load(http):
            while not stop.is_set():
                sent[0] += 1
                async with http.post(url + "/v1/completions", json={
                        "model": "mock", "prompt": LONG_PROMPT, "max_tokens": 4}) as resp:
                    await resp.read()
                    statuses.append(resp.status)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            clients = [asyncio.create_task(load(http)) for _ in range(4)]
            try:
                for role in ("prefill", "decode"):
                    api.update_pod("w", relabel(role))
                    await until(lambda: pool.get(w_url, role) is worker and worker.moving_to is None,
                                f"w to move to {role}")
                    assert worker.usable and worker.ever_up  # no new probe needed: same engine
                    done = len(statuses)
                    await until(lambda: len(statuses) >= done + 10, "requests after the move")
            finally:
                stop.set()
                await asyncio.gather(*clients)
        assert len(statuses) == sent[0] > 20 and set(statuses) == {200}, statuses[:10]
        d = pool.get(engines["d"].url, "decode")
        api.update_pod("d", relabel("prefill"))  # not kv-both: removed, then added as a new worker
        await until(lambda: pool.get(engines["d"].url, "prefill") is not None, "d re-added")
        assert pool.get(engines["d"].url, "prefill") is not d
        assert pool.get(engines["d"].url, "decode") is None

    async def main(api: FakeKubeApi) -> None:
        for name, proc in engines.items():
            notes = {"pd-plugins.io/kv-both": "true"} if name == "w" else {}
            api.add_pod(make_pod(name, "decode" if name == "w" else proc.role, "127.0.0.1",
                                 http_port=proc.port, annotations=notes))
        config = config_from_mapping({
            "policy": msgspec.to_builtins(preset("round_robin")),
            "discovery": {"kubeconfig": str(api.kubeconfig)},
            "health": {"interval_s": 0.5, "timeout_s": 2}})
        router = Router(config)
        runner = web.AppRunner(router.app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            await asyncio.wait_for(scenario(api, router, f"http://127.0.0.1:{port}"), 90)
        finally:
            await runner.cleanup()

    try:
        start_all(list(engines.values()), timeout=60)
        with FakeKubeApi() as api:
            api.kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
            asyncio.run(main(api))
    finally:
        for proc in engines.values():
            proc.stop(grace=5)
