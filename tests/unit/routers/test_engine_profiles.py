"""One profile per engine: every engine the vocabulary names has one, and the router's engine
differences (flow, startup checks, local prefill, health canary, load gauges) come from it."""

import asyncio

import pytest
from aiohttp import web

from pd_plugins.routers.cli import build_parser, config_from_args
from pd_plugins.routers.config import ConfigError, HealthSpec, RouterConfig, WorkerSpec
from pd_plugins.routers.flows import PROFILES, profile_for
from pd_plugins.routers.flows.sglang import SglangFlow
from pd_plugins.routers.flows.vllm import VllmPullFlow, VllmPushFlow
from pd_plugins.routers.health import PoolUpkeep
from pd_plugins.routers.upstream import new_session
from pd_plugins.routers.workers import WorkerPool
from pd_plugins.vocab.engines import ENGINES, LOAD_METRICS, TRANSFER_MODES
from tests.unit.routers.helpers import loopback_server

DECODE = WorkerSpec(url="http://127.0.0.1:8200")


def test_every_engine_has_one_profile_with_its_load_gauges():
    assert sorted(PROFILES) == sorted(ENGINES)
    for engine in ENGINES:
        assert profile_for(engine).name == engine
        assert profile_for(engine).load_metrics == LOAD_METRICS[engine]


@pytest.mark.parametrize("transfer", TRANSFER_MODES)
def test_flow_per_engine_and_transfer_mode(transfer):
    vllm_flow = profile_for("vllm").flow(transfer, 0.25)
    # the pools (shm, lmcache) run the pull flow's two steps
    assert type(vllm_flow) is (VllmPushFlow if transfer == "push" else VllmPullFlow)
    if transfer == "push":
        assert vllm_flow.head_start_s == 0.25
    assert type(profile_for("sglang").flow(transfer, 0.25)) is SglangFlow


@pytest.mark.parametrize("transfer", TRANSFER_MODES)
def test_the_command_line_takes_every_transfer_mode(transfer):
    argv = ["--decode", DECODE.url, "--transfer", transfer]
    assert config_from_args(build_parser().parse_args(argv)).transfer == transfer


@pytest.mark.parametrize("engine, transfer, worker, problem", [
    ("vllm", "pull", {}, None),
    ("vllm", "shm", {}, None),
    ("vllm", "push", {"engine_id": "p0"}, "vLLM push mode needs engine_id and kv_port"),
    ("vllm", "push", {"engine_id": "p0", "kv_port": 5600}, None),
    ("sglang", "pull", {}, "SGLang needs bootstrap_port"),
    ("sglang", "pull", {"bootstrap_port": 8998}, None),
])
def test_startup_checks_what_each_engine_needs_of_a_prefill(engine, transfer, worker, problem):
    from pd_plugins.routers.server import Router

    prefill = WorkerSpec(url="http://127.0.0.1:8100", **worker)
    config = RouterConfig(engine=engine, transfer=transfer, prefill=[prefill], decode=[DECODE])
    if problem is None:
        Router(config)
    else:
        with pytest.raises(ConfigError, match=f"prefill http://127.0.0.1:8100: {problem}"):
            Router(config)


@pytest.mark.parametrize("engine, transfer, worker, problem", [
    ("vllm", "push", {"engine_id": "p0"}, "vLLM push mode needs engine_id and kv_port"),
    ("sglang", "pull", {}, "SGLang needs bootstrap_port"),
    ("vllm", "push", {"engine_id": "p0", "kv_port": 5600}, None),
])
def test_a_prefill_added_while_serving_is_checked_too(engine, transfer, worker, problem):
    """The admin API and Kubernetes discovery add workers through Router.add_worker."""
    import asyncio

    from pd_plugins.routers.server import Router

    router = Router(RouterConfig(engine=engine, transfer=transfer, decode=[DECODE]))
    prefill = WorkerSpec(url="http://127.0.0.1:8100", **worker)
    if problem is None:
        assert asyncio.run(router.add_worker(prefill, "prefill")).url == prefill.url
    else:
        with pytest.raises(ConfigError, match=problem):
            asyncio.run(router.add_worker(prefill, "prefill"))
        assert router.groups[""].pool.get(prefill.url, "prefill") is None


def test_router_takes_local_prefill_from_the_profile():
    from pd_plugins.routers.server import Router

    sglang = RouterConfig(engine="sglang", decode=[DECODE],
                          prefill=[WorkerSpec(url="http://127.0.0.1:8100", bootstrap_port=8998)])
    assert Router(sglang).groups[""].scheduler.local_prefill is False
    assert Router(RouterConfig(decode=[DECODE])).groups[""].scheduler.local_prefill is True
    with pytest.raises(ConfigError, match="SGLang needs bootstrap_port"):
        Router(RouterConfig(engine="sglang", decode=[DECODE],
                            prefill=[WorkerSpec(url="http://127.0.0.1:8100")]))


@pytest.mark.parametrize("engine, canary", [("vllm", "POST /v1/completions"),
                                            ("sglang", "GET /health_generate")])
def test_health_canary_is_the_profiles(engine, canary):
    async def scenario() -> list[str]:
        seen = []

        async def record(request):
            seen.append(f"{request.method} {request.path}")
            if request.path == "/v1/models":
                return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})
            return web.json_response({"choices": [{"text": "x"}]})

        async with loopback_server({"/{tail:.*}": record}) as port:
            pool = WorkerPool()
            spec = WorkerSpec(url=f"http://127.0.0.1:{port}")
            worker = pool.add(spec, "decode", probe_first=True)
            config = RouterConfig(engine=engine, decode=[worker.spec],
                                  health=HealthSpec(timeout_s=5))
            session = new_session(1.0)
            try:
                assert await PoolUpkeep(config, pool, session).check(worker)
            finally:
                await session.close()
        return seen

    assert asyncio.run(scenario()) == ["GET /v1/models", canary]
