import msgspec
import pytest

from pd_plugins.routers.policy.prefix_index import block_keys
from pd_plugins.routers.request import BadRequest, parse_request

MODELS = {"tiny"}


def parse(body, kind="completion", strip=False, headers=None, max_model_len=512, raw=None):
    data = raw if raw is not None else msgspec.json.encode(body)
    return parse_request(data, kind, headers or {}, served_models=MODELS, max_model_len=max_model_len,
                         block_size=4, strip_transfer_fields=strip)


def refused(body, status=400, **kw) -> str:
    with pytest.raises(BadRequest) as info:
        parse(body, **kw)
    assert info.value.status == status
    return info.value.message


def test_token_prompt_gives_exact_block_keys_and_session():
    req = parse({"model": "tiny", "prompt": list(range(10)), "max_tokens": 5},
                headers={"x-session-id": "conv-1"})
    assert req.info.prompt_tokens == 10 and req.info.exact_tokens
    assert req.info.block_keys == block_keys(list(range(10)), 4) and len(req.info.block_keys) == 2
    assert req.info.session_id == "conv-1"


def test_text_prompt_is_estimated_and_shared_prefixes_share_keys():
    a = parse({"prompt": "x" * 64 + "first"}).info
    b = parse({"prompt": "x" * 64 + "second"}).info
    assert not a.exact_tokens and a.prompt_tokens == 17
    assert a.block_keys[:4] == b.block_keys[:4]


def test_malformed_bodies():
    assert "not valid JSON" in refused(None, raw=b"{not json")
    assert "JSON object" in refused([1, 2])
    assert "'prompt' is required" in refused({"model": "tiny"})
    assert "batched prompts" in refused({"prompt": ["a", "b"]})
    assert "string or a list of token ids" in refused({"prompt": 42})
    assert "'stream' must be" in refused({"prompt": "a", "stream": "yes"})
    assert "'messages' must be" in refused({"messages": []}, kind="chat")
    assert "messages[0]" in refused({"messages": ["hi"]}, kind="chat")


def test_unknown_model_is_404():
    assert "not served here" in refused({"model": "gpt-9", "prompt": "a"}, status=404)


@pytest.mark.parametrize("value", [0, -5, 1.5, True, "10"])
def test_bad_max_tokens(value):
    assert "positive integer" in refused({"prompt": "a", "max_tokens": value})


def test_context_limits():
    assert "does not fit" in refused({"prompt": "a", "max_tokens": 10**9})
    assert "exceeds the model's context" in refused({"prompt": list(range(600)), "max_tokens": 4})
    parse({"prompt": list(range(500)), "max_tokens": 12})  # fits exactly


@pytest.mark.parametrize("field", ["kv_transfer_params", "bootstrap_host", "bootstrap_room", "bootstrap_port"])
def test_client_transfer_fields_are_refused_or_stripped(field):
    body = {"prompt": "a", field: {"remote_block_ids": [1]} if field == "kv_transfer_params" else 1}
    assert field in refused(dict(body))
    assert field not in parse(dict(body), strip=True).body
