"""Failover: dead, failing, garbage-talking and hanging workers cost at most the requests they
held, and those end with a clear error, never a hang."""

import asyncio
import json
import time

import aiohttp
import pytest
import requests

from pd_plugins.testing.engine_harness import start_all
from pd_plugins.testing.router_harness import RouterProcess
from tests.router.conftest import LONG_PROMPT, deployment, mocks, wait_until

BODY = {"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 4}


def post(router, body=BODY, timeout=30):
    return requests.post(router.url + "/v1/completions", json=body, timeout=timeout)


async def one_request(session, url, i):
    """('ok' | 'error', detail) for a request; a clear error is a 5xx JSON or an SSE error event."""
    stream = i % 4 < 2  # not i % 2: alternating decode picks would give one worker all streams
    body = {"model": "mock", "prompt": f"{i} " + LONG_PROMPT, "max_tokens": 40, "stream": stream}
    async with session.post(url + "/v1/completions", json=body) as resp:
        text = await resp.text()
    if resp.status == 200 and not stream:
        return "ok", json.loads(text)["choices"][0]["text"]
    if resp.status == 200 and text.rstrip().endswith("data: [DONE]"):
        return "ok", text
    if resp.status == 200 and '"error"' in text:
        return "error", text  # the stream had begun: ended with an error event
    if resp.status >= 500 and json.loads(text)["error"]["message"]:
        return "error", text
    return "unclear", f"{resp.status}: {text[:300]}"


def run_wave(url, count, start=0, victim=None, kill_at_streaming=0, timeout=60):
    """Send `count` requests at once; kill -9 `victim` once it streams `kill_at_streaming`."""
    async def wave():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            tasks = [asyncio.create_task(one_request(session, url, start + i)) for i in range(count)]
            if victim is not None:
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    async with session.get(victim.url + "/mock/stats") as resp:
                        if (await resp.json())["streaming"] >= kill_at_streaming:
                            break
                    await asyncio.sleep(0.05)
                victim.kill()
            return await asyncio.gather(*tasks)
    return asyncio.run(wave())


def test_kill_decode_with_200_requests_in_flight():
    prefills, decodes = mocks(decodes=2, decode_args=("--tpot-ms", "100"))
    with deployment(prefills, decodes, "--policy", "least_loaded") as router:
        started = time.monotonic()
        results = run_wave(router.url, 200, victim=decodes[0], kill_at_streaming=10)
        elapsed = time.monotonic() - started
        outcomes = [r[0] for r in results]
        assert "unclear" not in outcomes, [r for r in results if r[0] == "unclear"][:3]
        # Only streams that had begun on the dead worker may fail (they were half the requests
        # at most, and only those routed to decode0); everything else completed.
        failed = outcomes.count("error")
        assert 0 < failed <= 100 and outcomes.count("ok") == 200 - failed
        assert all('"error"' in r[1] for r in results if r[0] == "error")
        assert elapsed < 45  # nothing waited for a timeout it should not have
        # New requests after the death all succeed on the survivor.
        after = run_wave(router.url, 20, start=1000)
        assert [r[0] for r in after] == ["ok"] * 20
        ready = requests.get(router.url + "/ready", timeout=5).json()
        assert ready["usable_decode"] == 1


@pytest.mark.parametrize("fault", ["fail_rate", "garbage_rate"])
def test_failing_prefill_is_retried_on_another(fault):
    prefills, decodes = mocks(prefills=2)
    with deployment(prefills, decodes, "--policy", "round_robin", "--route-header", "full") as router:
        prefills[0].set_faults(**{fault: 1.0})
        for _ in range(6):
            resp = post(router)
            assert resp.status_code == 200, resp.text
            assert f"prefill={prefills[1].url}" in resp.headers["x-pd-route"]
        assert "retried after 1 failure" in resp.headers["x-pd-route"] or \
            requests.get(router.url + "/ready", timeout=5).json()["usable_prefill"] == 1
        assert 'pd_router_retries_total{leg="prefill"}' in router.metrics()


@pytest.mark.parametrize("engine, transfer", [("sglang", "pull"), ("vllm", "push")])
def test_a_prefill_failing_beside_its_decode_stops_the_decode_and_is_retried(engine, transfer):
    """SGLang and push run both legs at once, the decode waiting for the prefill's KV: a prefill
    that fails closes the decode leg at once (not after the decode's 30 s KV wait) and the
    request is retried on another prefill."""
    prefills, decodes = mocks(engine, prefills=2, push=transfer == "push")
    with deployment(prefills, decodes, "--engine", engine, "--transfer", transfer,
                    "--policy", "round_robin", "--route-header", "full") as router:
        prefills[0].set_faults(fail_rate=1.0)
        for _ in range(4):
            started = time.monotonic()
            resp = post(router)
            assert resp.status_code == 200, resp.text
            assert f"prefill={prefills[1].url}" in resp.headers["x-pd-route"]
            assert time.monotonic() - started < 10
        assert decodes[0].stats()["cancelled"] >= 1  # the first try's decode leg, closed
        assert 'pd_router_retries_total{leg="prefill"}' in router.metrics()


def test_no_usable_prefill_falls_back_to_local_prefill_or_fails_clearly():
    prefills, decodes = mocks()
    with deployment(prefills, decodes, "--policy", "round_robin", "--route-header", "full") as router:
        prefills[0].set_faults(fail_rate=1.0)
        resp = post(router)
        assert resp.status_code == 200 and "prefill=local" in resp.headers["x-pd-route"]
        assert decodes[0].stats()["local"] == 1
    prefills, decodes = mocks()
    config = {"failover": {"local_prefill_fallback": False}}
    with deployment(prefills, decodes, "--policy", "round_robin", config=config) as router:
        prefills[0].set_faults(fail_rate=1.0)
        resp = post(router)
        assert resp.status_code in (502, 503)
        message = resp.json()["error"]["message"]
        assert "prefill" in message
        # route_header minimal (the default): no worker address in what a client is told
        assert prefills[0].url.split("//")[1] not in message and "127.0.0.1" not in message


def test_hanging_workers_hit_their_timeouts_and_are_routed_around():
    prefills, decodes = mocks(prefills=2, decodes=2)
    # a non-streamed decode leg comes whole at its end: decode_total_s is its timeout
    config = {"timeouts": {"prefill_s": 1.0, "decode_total_s": 1.0}}
    with deployment(prefills, decodes, "--policy", "round_robin", "--route-header", "full",
                    config=config) as router:
        prefills[0].set_faults(hang_rate=1.0)
        decodes[0].set_faults(hang_rate=1.0)
        for _ in range(4):
            t0 = time.monotonic()
            resp = post(router, timeout=20)
            assert resp.status_code == 200, resp.text
            assert time.monotonic() - t0 < 5
            route = resp.headers["x-pd-route"]
            assert f"prefill={prefills[1].url}" in route and f"decode={decodes[1].url}" in route


def test_hanging_only_worker_gives_a_clear_error_not_a_hang():
    prefills, decodes = mocks()
    config = {"timeouts": {"prefill_s": 1.0, "decode_total_s": 1.0}}
    # route_header full: the failure's detail is in the answer (minimal keeps it in the log)
    with deployment(prefills, decodes, "--policy", "round_robin", "--route-header", "full",
                    config=config) as router:
        decodes[0].set_faults(hang_rate=1.0)
        t0 = time.monotonic()
        resp = post(router, timeout=30)
        assert resp.status_code == 502 and "no response within 1 s" in resp.json()["error"]["message"]
        assert time.monotonic() - t0 < 10


def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event():
    # the mock breaks halfway through its third event: the client gets two whole events and an
    # error event of its own, each one JSON (not the half event glued to the error)
    prefills, decodes = mocks(decode_args=("--break-stream-after", "2", "--tpot-ms", "200"))
    with deployment(prefills, decodes, "--policy", "round_robin") as router:
        resp = requests.post(router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=20)
        assert resp.status_code == 200, resp.text
        events = [line for line in resp.text.splitlines() if line.startswith("data: ")]
        assert len(events) == 3 and "[DONE]" not in resp.text
        assert [json.loads(e[6:]).get("error") is not None for e in events] == [False, False, True]
        assert "mid-stream" in json.loads(events[-1][6:])["error"]["message"]


def test_a_long_answer_that_is_not_streamed_has_decode_total_s_not_the_first_byte_timeout():
    # a non-streamed answer's first byte is its last: bounded by decode_total_s; under the
    # first-byte timeout a healthy decode was failed, its generation retried, the client 502'd
    prefills, decodes = mocks(decode_args=("--tpot-ms", "300"))
    config = {"timeouts": {"decode_first_byte_s": 1.0, "decode_total_s": 30.0}}
    with deployment(prefills, decodes, "--policy", "round_robin", config=config) as router:
        resp = post(router, {**BODY, "max_tokens": 8})  # about 2.4 s of decoding
        assert resp.status_code == 200, resp.text
        assert decodes[0].stats()["cancelled"] == 0
        assert "retried" not in resp.headers["x-pd-route"]


def test_a_streamed_answer_that_is_not_an_event_stream_is_retried_elsewhere():
    # relayed, `200 <html>garbage` would look to an OpenAI client like a complete empty answer
    prefills, decodes = mocks(decodes=2)
    with deployment(prefills, decodes, "--policy", "round_robin") as router:
        decodes[0].set_faults(garbage_rate=1.0)
        for _ in range(2):
            resp = requests.post(router.url + "/v1/completions", json={**BODY, "stream": True},
                                 timeout=20)
            assert resp.status_code == 200, resp.text
            assert resp.text.rstrip().endswith("data: [DONE]"), resp.text


def test_health_checks_take_a_dead_worker_out_and_bring_it_back():
    prefills, decodes = mocks(prefills=2)
    with deployment(prefills, decodes) as router:
        prefills[0].stop(grace=1)
        usable = lambda: requests.get(router.url + "/ready", timeout=5).json()["usable_prefill"]  # noqa: E731
        wait_until(lambda: usable() == 1, 10, "the dead prefill to be taken out")
        prefills[0].start().wait_healthy(30)
        wait_until(lambda: usable() == 2, 10, "the restarted prefill to be taken back")


def test_slo_admission_rejects_early_without_a_retry_after_that_cannot_help():
    """150 ms prefills against a 100 ms TTFT SLO. On its latency priors the router refuses no
    prompt for its own size; once its fit has the 8 prefill legs, the prompt misses the SLO with
    nothing queued: a 429 without Retry-After (waiting would not help), and no worker sees it."""
    prefills, decodes = mocks(prefill_args=("--ttft-ms", "150"))
    config = {"latency": {"prefill_base_s": 0.5},
              "policy": {"admission": {"name": "slo", "params": {"ttft_slo_ms": 100}}}}
    with deployment(prefills, decodes, config=config) as router:
        for _ in range(8):  # on the priors (0.5 s, over the SLO): admitted
            assert post(router).status_code == 200
        served = decodes[0].stats()["requests"]
        resp = post(router)
        assert resp.status_code == 429 and "Retry-After" not in resp.headers
        assert "SLO" in resp.json()["error"]["message"]
        assert decodes[0].stats()["requests"] == served


def test_workers_started_after_the_router_are_taken_in_quickly():
    prefills, decodes = mocks()
    router = RouterProcess("router", prefill=[p.worker_arg() for p in prefills],
                           decode=[d.worker_arg() for d in decodes], args=("--log-format", "text"),
                           config={"health": {"interval_s": 60}})  # down workers are probed every second
    router.health_path = "/health"
    try:
        router.start().wait_healthy(30)
        ready = requests.get(router.url + "/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["usable_decode"] == 0
        assert post(router).status_code == 503
        start_all([*prefills, *decodes], timeout=30)
        wait_until(lambda: requests.get(router.url + "/ready", timeout=5).status_code == 200, 10,
                   "the late workers to be taken in")
        assert post(router).status_code == 200
    finally:
        for proc in [router, *prefills, *decodes]:
            proc.stop(grace=5)
