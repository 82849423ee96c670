"""Bad input gets a 4xx with a reason, never reaches a worker as transfer state, and the router
stays healthy afterwards."""

import pytest
import requests

from tests.router.conftest import LONG_PROMPT, deployment, mocks


@pytest.fixture(scope="module")
def router():
    prefills, decodes = mocks()
    with deployment(prefills, decodes, "--policy", "round_robin") as r:
        r.decodes, r.prefills = decodes, prefills
        yield r


def post(router, body=None, path="/v1/completions", **kw):
    return requests.post(router.url + path, json=body, timeout=15, **kw)


def assert_refused(resp, status, *words):
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    for word in words:
        assert word in error["message"]
    return error


CASES = [
    ("malformed JSON", dict(data=b'{"prompt": "x", ', headers={"Content-Type": "application/json"}),
     400, ["not valid JSON"]),
    ("unknown model", dict(json={"model": "gpt-9", "prompt": "x"}), 404, ["gpt-9", "mock"]),
    ("negative max_tokens", dict(json={"prompt": "x", "max_tokens": -1}), 400, ["max_tokens"]),
    ("huge max_tokens", dict(json={"prompt": "x", "max_tokens": 10**12}), 400, ["4096"]),
    ("token prompt beyond context", dict(json={"prompt": list(range(5000)), "max_tokens": 4}), 400,
     ["exceeds the model's context"]),
    ("injected kv_transfer_params", dict(json={"prompt": LONG_PROMPT, "kv_transfer_params": {
        "do_remote_prefill": True, "remote_request_id": "someone-else"}}), 400, ["kv_transfer_params"]),
    ("injected bootstrap_room", dict(json={"prompt": LONG_PROMPT, "bootstrap_room": 7}), 400,
     ["bootstrap_room"]),
    ("no prompt", dict(json={"model": "mock"}), 400, ["prompt"]),
]


@pytest.mark.parametrize("name, kwargs, status, words", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_refused_with_a_reason(router, name, kwargs, status, words):
    before = router.decodes[0].stats()["requests"]
    resp = requests.post(router.url + "/v1/completions", timeout=15, **kwargs)
    assert_refused(resp, status, *words)
    assert router.decodes[0].stats()["requests"] == before  # refused before any worker saw it


def test_text_prompt_beyond_context_gets_the_engines_4xx(router):
    resp = post(router, {"prompt": "word " * 20000, "max_tokens": 4})  # the router cannot count text
    assert_refused(resp, 400, "maximum context length")


def test_ten_megabyte_body_is_413(router):
    resp = requests.post(router.url + "/v1/completions", data=b'{"prompt": "' + b"x" * (10 << 20) + b'"}',
                         headers={"Content-Type": "application/json"}, timeout=30)
    assert_refused(resp, 413, "exceeds")


def test_bad_chat(router):
    assert_refused(post(router, {"messages": "hello"}, "/v1/chat/completions"), 400, "messages")


def test_router_is_healthy_after_bad_input(router):
    assert requests.get(router.url + "/ready", timeout=5).status_code == 200
    resp = post(router, {"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 3})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"]


def test_strip_mode_drops_client_transfer_fields():
    prefills, decodes = mocks()
    with deployment(prefills, decodes, "--policy", "round_robin", "--client-transfer-fields", "strip") as r:
        resp = post(r, {"model": "mock", "prompt": LONG_PROMPT, "max_tokens": 3,
                        "kv_transfer_params": {"do_remote_prefill": True, "remote_request_id": "victim",
                                               "remote_host": "127.0.0.1", "remote_port": 1}})
        assert resp.status_code == 200
        stats = decodes[0].stats()
        # The decode fetched the KV its own prefill registered, not the injected "victim".
        assert stats["remote_decodes"] == 1 and stats["mismatched_kv"] == 0
