"""Two models behind one pd-router, each with its own prefill and decode pd-mock-engines (each
mock serves one model name): requests reach their own model's workers, /v1/models lists the
union, a wrong or missing model is refused with a reason, and the admin API adds and removes a
model's workers."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import requests

from pd_plugins.testing.engine_harness import start_all
from pd_plugins.testing.raw_client import sample
from pd_plugins.testing.router_harness import MockEngineProcess, RouterProcess
from tests.router.conftest import FAST_HEALTH, LONG_PROMPT, wait_until

pytestmark = pytest.mark.processes

MODELS = ("alpha", "org/beta")
TOKEN = "models-admin-token"


def engines(model: str, tag: str) -> tuple[MockEngineProcess, MockEngineProcess]:
    return (MockEngineProcess(f"{tag}-prefill", role="prefill", args=("--model", model)),
            MockEngineProcess(f"{tag}-decode", role="decode", args=("--model", model)))


@contextlib.contextmanager
def two_models(*router_args: str, yaml_models: bool = False
               ) -> Iterator[tuple[RouterProcess, dict[str, tuple]]]:
    """pd-router over two models (flags, or a `models:` section with `yaml_models`)."""
    pools = {model: engines(model, f"m{i}") for i, model in enumerate(MODELS)}
    config = {"health": FAST_HEALTH}
    args = ["--log-format", "text", "--policy", "prefix_cache", *router_args]
    if yaml_models:
        config["models"] = [{"name": m, "prefill": [{"url": p.url}], "decode": [{"url": d.url}]}
                            for m, (p, d) in pools.items()]
    else:
        for model, (prefill, decode) in pools.items():
            args += ["--model", model, "--prefill", prefill.url, "--decode", decode.url]
    router = RouterProcess("router", args=tuple(args), config=config,
                           env={"PD_ROUTER_ADMIN_TOKEN": TOKEN})
    everything = [proc for pair in pools.values() for proc in pair]
    try:
        start_all(everything, timeout=60)
        start_all([router], timeout=60)
        yield router, pools
    finally:
        for proc in [router, *everything]:
            proc.stop(grace=5)


def complete(router: RouterProcess, model: str | None, **extra) -> requests.Response:
    """A prompt no earlier request shares a prefix with: every request is disaggregated."""
    complete.count = getattr(complete, "count", 0) + 1
    body = {"prompt": f"request {complete.count}: {LONG_PROMPT}", "max_tokens": 4, **extra}
    if model is not None:
        body["model"] = model
    return requests.post(router.url + "/v1/completions", json=body, timeout=30)


def admin(router: RouterProcess, method: str, **body) -> requests.Response:
    return requests.request(method, router.url + "/admin/workers", json=body or None, timeout=10,
                            headers={"Authorization": f"Bearer {TOKEN}"})


def served_legs(prefill: MockEngineProcess, decode: MockEngineProcess) -> tuple[int, int]:
    return prefill.stats()["prefill_legs"], decode.stats()["remote_decodes"]


def test_each_model_is_served_by_its_own_workers():
    with two_models("--route-header", "full") as (router, pools):
        for round_no in range(1, 4):
            for model, (prefill, decode) in pools.items():
                resp = complete(router, model, stream=round_no == 2)
                assert resp.status_code == 200, resp.text
                route = resp.headers["x-pd-route"]
                assert route.startswith(f"model={model}, prefill={prefill.url}, decode={decode.url}")
                # both legs went to this model's mocks, none to the other model's
                assert served_legs(prefill, decode) == (round_no, round_no)
                if round_no != 2:
                    assert resp.json()["model"] == model  # the mock answers for its own model
        # the workers saw their own model's name in every leg
        for model, (prefill, decode) in pools.items():
            assert {b.get("model") for b in prefill.bodies() + decode.bodies()} == {model}
        metrics = router.metrics()
        for model, (prefill, _) in pools.items():
            assert sample(metrics, "pd_router_worker_healthy", model=model, url=prefill.url) == 1


def test_models_listing_and_refusals_name_the_known_models():
    with two_models(yaml_models=True) as (router, pools):
        listing = requests.get(router.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in listing["data"]] == sorted(MODELS)
        assert all(m["max_model_len"] == 4096 for m in listing["data"])

        unknown = complete(router, "gamma")
        assert unknown.status_code == 404
        error = unknown.json()["error"]
        assert error["param"] == "model" and error["type"] == "invalid_request_error"
        assert "'gamma' is not served here; available: alpha, org/beta" in error["message"]

        missing = complete(router, None)
        assert missing.status_code == 400
        assert "'model' is required" in missing.json()["error"]["message"]
        assert "alpha, org/beta" in missing.json()["error"]["message"]
        # nothing reached a worker
        for prefill, decode in pools.values():
            assert served_legs(prefill, decode) == (0, 0)

        ok = complete(router, "org/beta")
        assert ok.status_code == 200 and ok.headers["x-pd-route"] == "model=org/beta, route=disaggregated"

        ready = requests.get(router.url + "/ready", timeout=10).json()
        assert ready["ready"] is True and ready["usable_decode"] == 2
        assert ready["models"] == {m: {"ready": True, "usable_decode": 1, "usable_prefill": 1}
                                   for m in MODELS}


def test_admin_adds_and_removes_a_models_workers():
    spare = MockEngineProcess("beta-decode-new", role="decode", args=("--model", "org/beta"))
    stray = MockEngineProcess("alpha-decode-stray", role="decode", args=("--model", "alpha"))
    with two_models() as (router, pools):
        start_all([spare, stray], timeout=30)
        try:
            # an engine of another model, added to beta: never up, so none of beta's requests
            # reach it (an engine serves its own model: vLLM would 404 them, or worse)
            wrong = admin(router, "POST", role="decode", worker={"url": stray.url}, model="org/beta")
            assert wrong.status_code == 200 and wrong.json()["healthy"] is False, wrong.text
            for _ in range(3):
                assert complete(router, "org/beta").status_code == 200
            assert stray.stats()["remote_decodes"] == 0
            assert admin(router, "DELETE", role="decode", worker={"url": stray.url}).status_code == 200

            listing = admin(router, "GET").json()["workers"]
            assert sorted((w["model"], w["role"]) for w in listing) == sorted(
                (m, r) for m in MODELS for r in ("prefill", "decode"))

            without = admin(router, "POST", role="decode", worker={"url": spare.url})
            assert without.status_code == 400 and "name one" in without.json()["error"]["message"]
            unknown = admin(router, "POST", role="decode", worker={"url": spare.url}, model="gamma")
            assert unknown.status_code == 404
            assert "available: alpha, org/beta" in unknown.json()["error"]["message"]
            taken = admin(router, "POST", role="decode", worker={"url": pools["alpha"][1].url},
                          model="org/beta")
            assert taken.status_code == 409

            added = admin(router, "POST", role="decode", worker={"url": spare.url}, model="org/beta")
            assert added.status_code == 200, added.text
            assert added.json() == {"added": spare.url, "role": "decode", "healthy": True,
                                    "model": "org/beta"}
            old_decode = pools["org/beta"][1]
            removed = admin(router, "DELETE", role="decode", worker={"url": old_decode.url},
                            model="org/beta")
            assert removed.status_code == 200 and removed.json()["model"] == "org/beta"
            before = old_decode.stats()["remote_decodes"]
            for _ in range(3):
                assert complete(router, "org/beta").status_code == 200
            assert spare.stats()["remote_decodes"] == 3
            assert old_decode.stats()["remote_decodes"] == before
            # alpha is untouched
            assert complete(router, "alpha").status_code == 200
            assert pools["alpha"][1].stats()["remote_decodes"] == 1

            # removing without a model finds it; removing it again finds nothing
            assert admin(router, "DELETE", role="decode", worker={"url": spare.url}).status_code == 200
            gone = admin(router, "DELETE", role="decode", worker={"url": spare.url}, model="org/beta")
            assert gone.status_code == 404
            # beta has no decode now: its requests get a 503, alpha's still work, /ready holds
            assert complete(router, "org/beta").status_code == 503
            assert complete(router, "alpha").status_code == 200
            ready = requests.get(router.url + "/ready", timeout=10)
            assert ready.status_code == 200 and ready.json()["models"]["org/beta"]["ready"] is False
        finally:
            spare.stop()
            stray.stop()


def test_a_model_whose_workers_are_all_down_does_not_take_the_others_down():
    with two_models() as (router, pools):
        prefill, decode = pools["alpha"]
        decode.stop(grace=5)
        prefill.stop(grace=5)
        wait_until(lambda: requests.get(router.url + "/ready", timeout=10)
                   .json()["models"]["alpha"]["usable_decode"] == 0, what="alpha to go down")
        assert complete(router, "alpha").status_code in (502, 503)
        assert complete(router, "org/beta").status_code == 200
        assert requests.get(router.url + "/ready", timeout=10).status_code == 200
