"""Workers added and removed through the admin API while requests keep flowing."""

import threading

import requests

from pd_plugins.testing.router_harness import MockEngineProcess
from tests.router.conftest import LONG_PROMPT, deployment, mocks, wait_until

TOKEN = "s3cret-token"


def admin(router, method, token=TOKEN, **body):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.request(method, router.url + "/admin/workers", json=body or None,
                            headers=headers, timeout=10)


def test_admin_api_needs_the_token():
    prefills, decodes = mocks()
    with deployment(prefills, decodes, env={"PD_ROUTER_ADMIN_TOKEN": TOKEN}) as router:
        assert admin(router, "GET", token=None).status_code == 401
        assert admin(router, "GET", token="wrong").status_code == 403
        listing = admin(router, "GET").json()["workers"]
        assert {w["role"] for w in listing} == {"prefill", "decode"}
        bad = admin(router, "POST", role="decode", worker={"url": "not a url"})
        assert bad.status_code == 400 and "http://host:port" in bad.json()["error"]["message"]


def test_admin_api_is_off_without_a_token():
    prefills, decodes = mocks()
    with deployment(prefills, decodes) as router:
        resp = admin(router, "GET")
        assert resp.status_code == 403 and "admin API is off" in resp.json()["error"]["message"]


def test_add_and_remove_workers_while_serving():
    prefills, decodes = mocks()
    spare = MockEngineProcess("decode-new", role="decode")
    with deployment(prefills, decodes, "--policy", "least_loaded",
                    env={"PD_ROUTER_ADMIN_TOKEN": TOKEN}) as router:
        spare.start().wait_healthy(30)
        statuses: list[int] = []
        stop = threading.Event()

        def load():
            while not stop.is_set():
                resp = requests.post(router.url + "/v1/completions", timeout=30, json={
                    "model": "mock", "prompt": LONG_PROMPT, "max_tokens": 3})
                statuses.append(resp.status_code)

        threads = [threading.Thread(target=load) for _ in range(4)]
        try:
            for t in threads:
                t.start()
            added = admin(router, "POST", role="decode", worker={"url": spare.url})
            assert added.status_code == 200 and added.json()["healthy"] is True
            wait_until(lambda: spare.stats()["remote_decodes"] >= 5, what="the new worker to serve")
            removed = admin(router, "DELETE", role="decode", worker={"url": decodes[0].url})
            assert removed.status_code == 200
            before = decodes[0].stats()["requests"]
            served_by_spare = spare.stats()["remote_decodes"]
            wait_until(lambda: spare.stats()["remote_decodes"] >= served_by_spare + 10,
                       what="10 more requests")
            assert decodes[0].stats()["requests"] <= before + 4  # at most what was in flight
        finally:
            stop.set()
            for t in threads:
                t.join()
            spare.stop()
        assert statuses and set(statuses) == {200}
        assert admin(router, "DELETE", role="decode", worker={"url": decodes[0].url}).status_code == 404
