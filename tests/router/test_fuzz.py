"""Property-based fuzzing (Hypothesis) of a real pd-router process in front of pd-mock-engine
processes, over completions and chat bodies, raw bytes and headers. Whatever a client sends:

- the router answers 5xx only for a request an engine actually received (an engine's failure is
  not the client's fault, but a request the router refused itself must get a 4xx with a reason);
- a refusal of its own is a JSON error with a message;
- a body that carries a transfer field (at the top level or inside `vllm_xargs`) is never
  forwarded (`client_transfer_fields: reject`, the default), and no engine ever receives a
  `vllm_xargs` with transfer semantics;
- the router never dies, and every worker's in-flight count goes back to zero.

Time budget: at most PD_FUZZ_EXAMPLES (default 200) examples per fuzz test and PD_FUZZ_SECONDS
(default 50) of requests over the four (0.45 completions, 0.35 chat, 0.2 raw bytes, 0.2 valid
requests with transfer fields hidden in them); CI runs the
defaults (about 60 s on 2 busy cores, 90 s at most). For a long run, e.g.
`PD_FUZZ_SECONDS=3600 PD_FUZZ_EXAMPLES=1000000 .venv/bin/python -m pytest -p no:cacheprovider
tests/router/test_fuzz.py`. A failure prints the smallest example Hypothesis found.
"""

from __future__ import annotations

import math
import os
import re
import time
from typing import Callable

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.conftest import LONG_PROMPT, deployment, mocks

SECONDS = float(os.environ.get("PD_FUZZ_SECONDS", "50"))
EXAMPLES = int(os.environ.get("PD_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
IN_FLIGHT = re.compile(r'^pd_router_worker_in_flight\{[^}]*\} (\S+)$', re.M)


class Budget:
    """Wall-clock budget of one test: past it, examples pass without a request (Hypothesis still
    draws them, which costs microseconds), so a slow machine cannot push CI past its limit."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, None

    def run(self, check_one: Callable[[], None]) -> None:
        if self.started is None:
            self.started = time.monotonic()
        if time.monotonic() - self.started > self.seconds:
            return
        try:
            check_one()
        except BaseException:
            self.seconds = math.inf  # Hypothesis replays a failure to shrink it: let it
            raise


@pytest.fixture(scope="module")
def router():
    prefills, decodes = mocks(prefills=1, decodes=2)
    with deployment(prefills, decodes, "--policy", "round_robin") as r:
        r.engines = [*prefills, *decodes]
        yield r


# -- strategies ---------------------------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(-3, 50)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
token_ids = st.lists(st.integers(-5, 2**66), min_size=0, max_size=40)
prompts = (st.text(max_size=200) | st.just(LONG_PROMPT) | token_ids | st.lists(token_ids, max_size=2)
           | st.lists(st.text(max_size=20), max_size=3) | json_values)
content_parts = st.one_of(
    st.text(max_size=30),
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_text", "x"])},
                          optional={"text": json_values | st.text(max_size=30), "image_url": json_values}),
    json_values)
messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | json_values},
                          optional={"content": st.text(max_size=100) | st.lists(content_parts, max_size=3)
                                    | json_values, "name": json_values}),
    json_values), max_size=4)
TRANSFER_NAMES = ["kv_transfer_params", "ec_transfer_params", "bootstrap_room", "bootstrap_host",
                  "disagg_prefill_dp_rank", "data_parallel_rank", "routed_dp_rank"]
xargs = st.dictionaries(st.sampled_from(["kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode",
                                         "ext", "n"]) | st.text(max_size=8),
                        json_values, max_size=3) | json_values
common = {"model": st.just("mock") | json_values, "max_tokens": st.integers(-2, 10) | json_values,
          "max_completion_tokens": st.integers(-2, 10) | json_values,
          "stream": st.booleans() | json_values, "vllm_xargs": xargs,
          "temperature": json_values, "stop": json_values, "n": json_values, "logprobs": json_values,
          "user": json_values, "session_id": json_values,
          **{name: json_values for name in TRANSFER_NAMES}}
completion_bodies = st.fixed_dictionaries({"prompt": prompts}, optional=common)
chat_bodies = st.fixed_dictionaries({"messages": messages}, optional=common)
header_bytes = st.binary(max_size=150).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"").lstrip())
headers = st.fixed_dictionaries({}, optional={
    "X-Request-Id": header_bytes | st.text(max_size=200).map(lambda t: t.strip().encode()),
    "x-session-id": header_bytes | st.text(max_size=200).map(lambda t: t.strip().encode()),
    "x-user-id": header_bytes, "Content-Type": st.sampled_from(["application/json", "text/plain", ""]),
    "Authorization": header_bytes})


def deep(n: int) -> bytes:
    return b'{"prompt": "x", "a": ' + b"[" * n + b"]" * n + b"}"


raw_bodies = st.binary(max_size=300) | st.integers(1, 4000).map(deep) | st.builds(
    lambda body, cut: body[:cut], st.just(b'{"model": "mock", "prompt": "hello", "max_tokens": 3}'),
    st.integers(0, 50))


# -- the properties -----------------------------------------------------------------------------
XARGS_TRANSFER = ("kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode")


def client_transfer_fields(body) -> list[str]:
    """The transfer fields a client body carries (what the router must never forward)."""
    if not isinstance(body, dict):
        return []
    found = [name for name in body if name in TRANSFER_NAMES or name.endswith("_transfer_params")
             or name.startswith(("bootstrap_", "disagg_"))]
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        found += [f"vllm_xargs.{name}" for name in xargs if name in XARGS_TRANSFER]
    return found


def engine_requests(router) -> int:
    return sum(engine.stats()["requests"] for engine in router.engines)


def in_flight(router) -> list[float]:
    return [float(v) for v in IN_FLIGHT.findall(router.metrics())]


def check(router, path: str, **kwargs) -> None:
    before = engine_requests(router)
    try:
        resp = requests.post(router.url + path, timeout=30, **kwargs)
        status, body = resp.status_code, resp.content
    except requests.exceptions.InvalidHeader:
        return  # requests itself would not send it
    assert router.proc.poll() is None, f"the router died:\n{router.log_tail()}"
    forwarded = engine_requests(router) > before
    assert status < 500 or forwarded, f"{status} for a request no engine received: {body[:300]!r}"
    if forwarded:
        smuggled = client_transfer_fields(kwargs.get("json"))
        assert not smuggled, f"forwarded a body with client transfer fields {smuggled}"
        for engine in router.engines:
            for received in engine.bodies()[-4:]:
                xargs = received.get("vllm_xargs")
                assert not (isinstance(xargs, dict) and set(xargs) & set(XARGS_TRANSFER)), \
                    f"{engine.url} received vllm_xargs {xargs!r:.200}"
    if not forwarded and resp.headers.get("Content-Type", "").startswith("application/json"):
        assert status < 400 or resp.json()["error"]["message"], body[:300]
    deadline = time.monotonic() + 10
    assert len(in_flight(router)) == len(router.engines)  # the gauges are there to be read
    while any(in_flight(router)):
        assert time.monotonic() < deadline, f"in-flight counts stay at {in_flight(router)}"
        time.sleep(0.05)


completion_budget, chat_budget, raw_budget = Budget(SECONDS * 0.45), Budget(SECONDS * 0.35), Budget(SECONDS * 0.2)


@FUZZ
@given(body=completion_bodies, headers=headers)
def test_completions_fuzz(router, body, headers):
    completion_budget.run(lambda: check(router, "/v1/completions", json=body, headers=headers))


@FUZZ
@given(body=chat_bodies, headers=headers)
def test_chat_fuzz(router, body, headers):
    chat_budget.run(lambda: check(router, "/v1/chat/completions", json=body, headers=headers))


@FUZZ
@given(raw=raw_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_raw_bytes_fuzz(router, raw, path):
    raw_budget.run(lambda: check(router, path, data=raw, headers={"Content-Type": "application/json"}))


# Valid requests with transfer fields hidden in them: the bodies above are mostly invalid for
# other reasons, so this is where a smuggled field would get through if the router let it.
xargs_scalars = st.text(max_size=12) | st.integers(-3, 2**40) | st.floats(allow_nan=False, allow_infinity=False)
smuggling_bodies = st.builds(
    lambda top, hidden, extra: {"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 2, **top,
                                "vllm_xargs": {**extra, **hidden}},
    st.dictionaries(st.sampled_from(TRANSFER_NAMES), json_values, max_size=2),
    st.dictionaries(st.sampled_from(XARGS_TRANSFER), xargs_scalars | st.lists(xargs_scalars, max_size=3),
                    max_size=2),
    st.dictionaries(st.sampled_from(["ext", "n", "seed_x"]), xargs_scalars, max_size=2))
smuggling_budget = Budget(SECONDS * 0.2)


@FUZZ
@given(body=smuggling_bodies)
def test_transfer_fields_never_reach_an_engine(router, body):
    smuggling_budget.run(lambda: check(router, "/v1/completions", json=body))


def test_router_still_serves_after_the_fuzz(router):
    resp = requests.post(router.url + "/v1/completions", timeout=15,
                         json={"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    assert not any(in_flight(router))
