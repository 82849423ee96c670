"""Engine /metrics scrapes: odd lines are skipped, and no answer a worker gives stops the scrape
loop (a stopped loop froze every worker's load for good). The loop runs against a real aiohttp
server on loopback."""

import asyncio
import math

import pytest
from aiohttp import web

from pd_plugins.routers.config import HealthSpec, RouterConfig, WorkerSpec
from pd_plugins.routers.health import PoolUpkeep, parse_engine_metrics
from pd_plugins.routers.upstream import new_session
from pd_plugins.routers.workers import WorkerPool
from tests.unit.routers.helpers import loopback_server


@pytest.mark.parametrize("text", [
    "vllm:num_requests_waiting",                   # the name alone: was an IndexError
    "vllm:num_requests_waiting{",                  # labels never closed
    "vllm:num_requests_waiting{engine=\"0\"}",     # no value
    "vllm:num_requests_waiting NaN",
    "vllm:num_requests_waiting +Inf",
    "vllm:num_requests_waiting -3",
    "vllm:num_requests_waiting garbage",
    "vllm:num_requests_waiting \ufffd\ufffd",
])
def test_unparsable_or_meaningless_samples_are_skipped(text):
    assert parse_engine_metrics(text + "\nvllm:num_requests_running 2\n", "vllm") == (0.0, 2.0, 0.0)


def test_values_with_timestamps_and_braces_in_labels():
    text = ('vllm:num_requests_waiting{model_name="a}b c"} 3 1712345678000\n'
            "vllm:kv_cache_usage_perc 0.5 1712345678000\n")
    assert parse_engine_metrics(text, "vllm") == (3.0, 0.0, 0.5)


def test_usage_is_capped_and_never_nan():
    waiting, running, usage = parse_engine_metrics("vllm:kv_cache_usage_perc 7\n", "vllm")
    assert usage == 1.0 and not any(math.isnan(v) for v in (waiting, running, usage))


GOOD = b"vllm:num_requests_waiting 4\nvllm:num_requests_running 3\nvllm:kv_cache_usage_perc 0.5\n"
BAD_ANSWERS = [
    b"\xff\xfe\x00 not utf-8 \x80\x81",
    b"vllm:num_requests_waiting\n",
    b"vllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc nan\n",
    b"<html>" + bytes(range(256)) * 10,
]


def test_scrape_loop_survives_every_bad_answer_and_updates_load_after():
    async def scenario():
        answers = [*BAD_ANSWERS, GOOD]
        served = []

        async def metrics(request):
            body = answers[min(len(served), len(answers) - 1)]
            served.append(body)
            return web.Response(body=body, content_type="text/plain")

        async with loopback_server({"/metrics": metrics}) as port:
            pool = WorkerPool()
            worker = pool.add(WorkerSpec(url=f"http://127.0.0.1:{port}"), "decode")
            config = RouterConfig(decode=[worker.spec], health=HealthSpec(metrics_interval_s=0.01))
            session = new_session(1.0)
            upkeep = PoolUpkeep(config, pool, session)
            task = asyncio.create_task(upkeep._metrics_loop())
            try:
                for _ in range(500):
                    if worker.engine_waiting == 4.0 or task.done():
                        break
                    await asyncio.sleep(0.01)
                assert not task.done(), task.exception()
                assert len(served) > len(BAD_ANSWERS)  # every bad answer, then the good one
                assert (worker.engine_waiting, worker.engine_running,
                        worker.kv_usage) == (4.0, 3.0, 0.5)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await session.close()

    asyncio.run(scenario())


def test_a_worker_that_injects_kv_faults_is_warned_about_once(caplog):
    """A worker whose /metrics shows injected KV faults (a test setting) is named in a warning,
    once; one that shows 0 is not."""
    async def scenario():
        injected = {"value": 0.0}

        async def metrics(request):
            return web.Response(body=f"vllm:num_requests_running 1\n"
                                     f"vllm:pd_kv_faults_injected_total {injected['value']}\n",
                                content_type="text/plain")

        async with loopback_server({"/metrics": metrics}) as port:
            pool = WorkerPool()
            worker = pool.add(WorkerSpec(url=f"http://127.0.0.1:{port}"), "decode")
            session = new_session(1.0)
            upkeep = PoolUpkeep(RouterConfig(decode=[worker.spec]), pool, session)
            try:
                with caplog.at_level("WARNING", logger="pd_router.health"):
                    await upkeep.scrape(worker)
                    assert "fault injection" not in caplog.text
                    injected["value"] = 3.0
                    await upkeep.scrape(worker)
                    await upkeep.scrape(worker)
            finally:
                await session.close()
        warnings = [r.getMessage() for r in caplog.records if "fault injection" in r.getMessage()]
        assert len(warnings) == 1 and worker.url in warnings[0] and "3 KV faults" in warnings[0]

    asyncio.run(scenario())


def test_a_probe_answer_past_its_bound_fails_the_probe(monkeypatch):
    """/v1/models and the canary are read at most MAX_PROBE_BYTES, as /metrics is: no worker
    makes the router buffer without end."""
    from pd_plugins.routers import health

    monkeypatch.setattr(health, "MAX_PROBE_BYTES", 1000)

    async def scenario():
        async def models(request):
            return web.json_response({"data": [{"id": "m" * 2000}]})

        async with loopback_server({"/v1/models": models}) as port:
            pool = WorkerPool()
            worker = pool.add(WorkerSpec(url=f"http://127.0.0.1:{port}"), "decode")
            session = new_session(1.0)
            try:
                upkeep = PoolUpkeep(RouterConfig(decode=[worker.spec]), pool, session)
                with pytest.raises(ValueError, match="/v1/models is larger than 1000 bytes"):
                    await upkeep._probe(worker)
            finally:
                await session.close()

    asyncio.run(scenario())


def test_finite_samples_whose_sum_is_not_are_an_unusable_scrape():
    # two label sets of 1e308 sum to inf: the load was inf, every score NaN, and the pickers
    # of least_loaded, default and goodput raised on every request to the model
    text = ('vllm:num_requests_running{engine="0"} 1e308\n'
            'vllm:num_requests_running{engine="1"} 1e308\n')
    with pytest.raises(ValueError, match="finite"):
        parse_engine_metrics(text, "vllm")


def test_a_picker_given_scores_that_do_not_compare_still_picks():
    from pd_plugins.routers.policy.pickers import MaxScorePicker

    picker = MaxScorePicker()
    assert {picker.pick(["a", "b"], [math.nan, math.nan]) for _ in range(4)} == {"a", "b"}


def test_health_loop_survives_an_unexpected_error_in_a_round(caplog):
    """A round that raises (here the router's on_change, as a bug there would) is logged, at
    most once a minute, and the probes go on: before, the health loop ended for good and no
    worker was ever probed again (a down one never came back)."""
    async def scenario():
        probes = []

        async def models(request):
            probes.append(request.path)
            return web.json_response({"object": "list", "data": [{"id": "mock", "object": "model"}]})

        async with loopback_server({"/v1/models": models}) as port:
            pool = WorkerPool()
            pool.add(WorkerSpec(url=f"http://127.0.0.1:{port}"), "decode", probe_first=True)
            config = RouterConfig(decode=[WorkerSpec(url=f"http://127.0.0.1:{port}")],
                                  health=HealthSpec(interval_s=0.05, canary=False))
            session = new_session(1.0)
            upkeep = PoolUpkeep(config, pool, session)
            changes = []

            def on_change():
                changes.append(1)
                if len(changes) <= 2:
                    raise RuntimeError("a bug in on_change")
            upkeep.on_change = on_change
            task = asyncio.create_task(upkeep._health_loop())
            try:
                with caplog.at_level("ERROR", logger="pd_router.health"):
                    for _ in range(300):
                        if len(changes) >= 4 or task.done():
                            break
                        await asyncio.sleep(0.01)
                assert not task.done(), task.exception()
                assert len(changes) >= 4 and len(probes) >= 4
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await session.close()
        errors = [r for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "health checks go on" in errors[0].getMessage()

    asyncio.run(scenario())
