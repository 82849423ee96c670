"""What a hostile client can send pd-router: transfer fields hidden in `vllm_xargs` and the like never
reach an engine, odd bodies and headers get a 400 with a reason (never a 500), and the router tells
a client nothing about the deployment (x-pd-route, /ready) unless configured to. The engines are
pd-mock-engine processes, which record the bodies they receive (GET /mock/bodies)."""

import pytest
import requests

from tests.router.conftest import LONG_PROMPT, deployment, mocks

TOKEN = "admin-s3cret"
CHAT = {"model": "mock", "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 3}
COMPLETION = {"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 3}
# Everything with transfer semantics a client may try, at the top level and inside vllm_xargs.
SMUGGLED = {"ec_transfer_params": {"x": 1}, "routed_dp_rank": 1, "disagg_prefill_dp_rank": 0,
            "bootstrap_host": "10.0.0.66",
            "vllm_xargs": {"kv_transfer_params": "", "ec_transfer_params": 0,
                           "kv_cache_report_mode": "full", "my_extension": 7}}


@pytest.fixture(scope="module")
def router():
    prefills, decodes = mocks()
    with deployment(prefills, decodes, "--policy", "round_robin",
                    env={"PD_ROUTER_ADMIN_TOKEN": TOKEN}) as r:
        r.decodes, r.prefills = decodes, prefills
        yield r


def engine_requests(router) -> int:
    return sum(m.stats()["requests"] for m in [*router.prefills, *router.decodes])


def assert_refused(resp, status, *words):
    assert resp.status_code == status, resp.text
    message = resp.json()["error"]["message"]
    assert all(word in message for word in words), message


def assert_no_client_transfer_state(body):
    for name in ("ec_transfer_params", "routed_dp_rank", "disagg_prefill_dp_rank", "bootstrap_host"):
        assert name not in body, body
    assert body["vllm_xargs"] == {"my_extension": 7}, body
    params = body.get("kv_transfer_params")
    assert params is None or isinstance(params, dict), body  # only ever the router's own


@pytest.mark.parametrize("field", ["kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode"])
def test_transfer_params_in_vllm_xargs_are_refused_before_any_engine(router, field):
    before = engine_requests(router)
    resp = requests.post(router.url + "/v1/completions", timeout=15,
                         json={**COMPLETION, "vllm_xargs": {field: ""}})
    assert_refused(resp, 400, f"vllm_xargs.{field}")
    assert engine_requests(router) == before


def test_vllm_xargs_outside_vllms_schema_is_refused(router):
    resp = requests.post(router.url + "/v1/completions", timeout=15,
                         json={**COMPLETION, "vllm_xargs": {"k": {"remote_host": "10.0.0.66"}}})
    assert_refused(resp, 400, "vllm_xargs.k")


def test_strip_mode_removes_smuggled_fields_from_every_leg_and_route():
    prefills, decodes = mocks()
    with deployment(prefills, decodes, "--policy", "round_robin", "--client-transfer-fields", "strip") as r:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            for stream in (False, True):
                resp = requests.post(r.url + path, json={**body, **SMUGGLED, "stream": stream}, timeout=15)
                assert resp.status_code == 200, resp.text
        decode_bodies, prefill_bodies = decodes[0].bodies(), prefills[0].bodies()
        assert len(decode_bodies) == 4 and len(prefill_bodies) == 4
        for body in decode_bodies + prefill_bodies:
            assert_no_client_transfer_state(body)
        # A local prefill forwards the client's whole body to the decode: stripped there too.
        prefills[0].set_faults(fail_rate=1.0)
        resp = requests.post(r.url + "/v1/completions", json={**COMPLETION, **SMUGGLED}, timeout=15)
        assert resp.status_code == 200, resp.text
        local = decodes[0].bodies()[-1]
        assert "kv_transfer_params" not in local and decodes[0].stats()["local"] == 1
        assert_no_client_transfer_state(local)
        assert decodes[0].stats()["mismatched_kv"] == 0


DEEP = 5000
BAD_INPUT = [
    ("JSON nested 5,000 deep", dict(data=b'{"prompt": "x", "a": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
     ["nested deeper"]),
    ("JSON object nested 5,000 deep", dict(data=b'{"prompt": "x", "a": ' + b'{"a": ' * DEEP + b"1"
                                           + b"}" * DEEP + b"}"), ["nested deeper"]),
    ("prompt nested 60 deep", dict(data=b'{"prompt": ' + b"[" * 60 + b"]" * 60 + b"}"), ["prompt"]),
    ("number out of range", dict(data=b'{"prompt": "x", "temperature": 1e999}'), ["not valid JSON"]),
    ("chat text part that is a number", dict(path="/v1/chat/completions", json={
        "model": "mock", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
     ["content[0].text"]),
    ("chat part that is a number", dict(path="/v1/chat/completions", json={
        "model": "mock", "messages": [{"role": "user", "content": [5]}]}), ["content[0]"]),
    ("X-Request-Id not UTF-8", dict(json=COMPLETION, headers={"X-Request-Id": b"\xff\xfe\x80"}),
     ["X-Request-Id"]),
    # aiohttp's own parser refuses control bytes in a header (a plain-text 400): no words to check
    ("X-Request-Id with control bytes", dict(json=COMPLETION, headers={"X-Request-Id": b"a\x01b"}), []),
    ("X-Request-Id too long", dict(json=COMPLETION, headers={"X-Request-Id": "r" * 500}), ["X-Request-Id"]),
    ("session header not UTF-8", dict(json=COMPLETION, headers={"x-session-id": b"\xc3\x28"}),
     ["session id"]),
    # what the decode refused only after the prefill had run (its one-token leg drops both)
    ("stream_options without stream", dict(json={**COMPLETION, "stream_options": {"include_usage": True}}),
     ["stream_options"]),
    ("min_tokens past max_tokens", dict(json={**COMPLETION, "min_tokens": 4}), ["min_tokens"]),
]


@pytest.mark.parametrize("name, kwargs, words", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_odd_bodies_and_headers_get_a_400_with_a_reason(router, name, kwargs, words):
    kwargs = dict(kwargs)
    path = kwargs.pop("path", "/v1/completions")
    if "data" in kwargs:
        kwargs["headers"] = {"Content-Type": "application/json"}
    before = engine_requests(router)
    resp = requests.post(router.url + path, timeout=15, **kwargs)
    if words:
        assert_refused(resp, 400, *words)
    assert resp.status_code == 400, resp.text
    assert engine_requests(router) == before
    assert requests.get(router.url + "/health", timeout=5).status_code == 200


def test_route_header_tells_a_client_only_the_decision(router):
    resp = requests.post(router.url + "/v1/completions", json=COMPLETION, timeout=15,
                         headers={"x-session-id": "private-conversation-42"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-pd-route"] == "route=disaggregated"
    stream = requests.post(router.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=15)
    assert stream.headers["x-pd-route"] == "route=disaggregated"
    for mock in [*router.prefills, *router.decodes]:
        assert str(mock.port) not in resp.headers["x-pd-route"]


def test_ready_lists_workers_only_to_the_admin(router):
    # a token that is not UTF-8 is just a wrong one (it was a 500: admin.py encoded it strictly)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                    {"Authorization": b"Bearer \xff\xfe"}):
        anonymous = requests.get(router.url + "/ready", timeout=5, headers=headers)
        assert anonymous.status_code == 200
        body = anonymous.json()
        assert body == {"ready": True, "usable_decode": 1, "usable_prefill": 1}, body
        assert "127.0.0.1" not in anonymous.text
    admin = requests.get(router.url + "/ready", timeout=5, headers={"Authorization": f"Bearer {TOKEN}"})
    urls = {w["url"] for w in admin.json()["workers"]}
    assert urls == {router.prefills[0].url, router.decodes[0].url}


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_that_refuses_after_a_pull_prefill_releases_the_prefills_kv(router, stream):
    """A request the prefill's one-token leg passes and the decode refuses (here: max_tokens past
    the context, a check the router cannot make without a tokenizer): the client gets the decode's
    400, and the KV the prefill holds for it is read (released) by a one-token decode leg, not
    held until the prefill's lease runs out (vLLM: VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s)."""
    from tests.router.conftest import wait_until

    prefill = router.prefills[0]
    for i in range(3):
        body = {**CHAT, "messages": [{"role": "user", "content": f"{i} {stream} {LONG_PROMPT}"}],
                "max_tokens": 4090, "stream": stream}
        resp = requests.post(router.url + "/v1/chat/completions", json=body, timeout=15)
        assert_refused(resp, 400, "maximum context length")
    wait_until(lambda: prefill.stats()["rooms_held"] == 0, timeout=10, what="the prefill's KV released")


def test_parallel_sampling_is_served_on_the_decode_alone(router):
    """n > 1: vLLM fans the request out into samples that share one kv_transfer_params, and the
    prefill frees the KV after the first sample's read (the others read freed blocks); so it is
    served on the decode worker alone, which prefills it itself."""
    before = router.prefills[0].stats()["requests"]
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        for extra in ({"n": 2}, {"use_beam_search": True}):
            resp = requests.post(router.url + path, json={**body, **extra}, timeout=15)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-pd-route"] == "route=local"
    assert router.prefills[0].stats()["requests"] == before
    assert requests.post(router.url + "/v1/completions", json=COMPLETION,
                         timeout=15).headers["x-pd-route"] == "route=disaggregated"


def test_parallel_sampling_is_refused_where_the_decode_cannot_prefill():
    prefills, decodes = mocks(engine="sglang")
    with deployment(prefills, decodes, "--engine", "sglang", "--policy", "round_robin") as r:
        resp = requests.post(r.url + "/v1/completions", json={**COMPLETION, "n": 2}, timeout=15)
        assert_refused(resp, 400, "parallel sampling")
        assert prefills[0].stats()["requests"] == decodes[0].stats()["requests"] == 0


def test_parallel_sampling_is_refused_where_decodes_may_not_prefill_beyond_the_policy(tmp_path):
    """failover.local_prefill_fallback off: a client's n > 1 does not make a decode worker
    prefill a prompt the policy sends to a prefill worker (any prompt up to max_body_bytes)."""
    prefills, decodes = mocks()
    with deployment(prefills, decodes, "--policy", "round_robin",
                    config={"failover": {"local_prefill_fallback": False}}) as r:
        resp = requests.post(r.url + "/v1/completions", json={**COMPLETION, "n": 2}, timeout=15)
        assert_refused(resp, 400, "local_prefill_fallback")
        assert prefills[0].stats()["requests"] == decodes[0].stats()["requests"] == 0


def test_long_prompts_with_a_tokenizer_are_refused_by_length_or_tokenized_off_the_loop(tmp_path):
    from tests.unit.routers.helpers import build_tokenizer

    prefills, decodes = mocks()
    with deployment(prefills, decodes, "--policy", "round_robin",
                    "--tokenizer", build_tokenizer(tmp_path)) as r:
        # 3 MiB: tokenizing it held the router's loop 4 s; its length alone overflows the context
        body = {**COMPLETION, "prompt": "the quick brown fox jumps over the lazy dog " * 72_000}
        resp = requests.post(r.url + "/v1/completions", json=body, timeout=15)
        assert_refused(resp, 400, "at least", "exceeds the model's context")
        assert resp.elapsed.total_seconds() < 2
        # a long one that fits: tokenized on a thread, then served as any other
        for stream in (False, True):
            body = {**COMPLETION, "prompt": "the quick brown fox jumps over the lazy dog " * 200,
                    "stream": stream}
            resp = requests.post(r.url + "/v1/completions", json=body, timeout=15)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-pd-route"] == "route=disaggregated"
        assert prefills[0].stats()["requests"] == decodes[0].stats()["requests"] == 2
        # one within the length bound whose tokens overflow the context: refused once tokenized,
        # before any engine
        body = {**COMPLETION, "prompt": "the quick brown fox jumps over the lazy dog " * 500}
        resp = requests.post(r.url + "/v1/completions", json=body, timeout=15)
        assert_refused(resp, 400, "prompt of", "tokens plus 3 to generate exceeds")
        assert "at least" not in resp.text and prefills[0].stats()["requests"] == 2


def test_connections_past_the_cap_are_refused_and_counted_on_metrics():
    """max_connections: idle connections hold the router's slots; the first past the cap is
    answered 503 as it connects, and /metrics counts it once a slot is free again."""
    import socket
    import time

    from pd_plugins.testing.engine_harness import metric_value

    prefills, decodes = mocks()
    with deployment(prefills, decodes, config={"max_connections": 2}) as r:
        host, port = r.url.removeprefix("http://").split(":")
        held: list[socket.socket] = []
        answer = b""
        try:
            # (the harness's own keep-alive connection may hold a slot too: open until refused)
            for _ in range(4):
                sock = socket.create_connection((host, int(port)), timeout=5)
                held.append(sock)
                sock.settimeout(0.5)  # an accepted idle connection gets no answer
                try:
                    answer = sock.recv(65536)
                except TimeoutError:
                    continue
                break
            assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer, answer
            assert len(held) <= 3
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 5  # until the router has seen the idle ones close
        while True:
            resp = requests.get(r.url + "/metrics", timeout=15)
            if resp.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert resp.status_code == 200, resp.text
        assert metric_value(resp.text, "pd_router_refused_connections_total") >= 1
        assert metric_value(resp.text, "pd_router_client_connections") >= 1  # this scrape's own
