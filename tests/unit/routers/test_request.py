import msgspec
import pytest

from pd_plugins.vocab.block_keys import block_keys
from pd_plugins.routers.request import BadRequest, parse_request
from tests.unit.routers.helpers import Target, serving

MODELS = {"tiny"}


def parse(body, kind="completion", strip=False, headers=None, max_model_len=512, raw=None):
    data = raw if raw is not None else msgspec.json.encode(body)
    return parse_request(data, kind, headers or {}, strip_transfer_fields=strip,
                         select_model=serving(Target(max_model_len, key_block_size=4), *MODELS))


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


def test_a_cache_salt_keys_the_prompt_apart_as_vllm_does():
    # a tenant's salt keeps its prompts' keys (and so the router's prefix credit and its
    # x-pd-route answer) apart from every other tenant's
    body = {"model": "tiny", "prompt": list(range(10))}
    plain = parse(body).info.block_keys
    salted = parse({**body, "cache_salt": "tenant-a"}).info.block_keys
    assert len(salted) == len(plain) == 2 and not set(salted) & set(plain)
    assert parse({**body, "cache_salt": "tenant-a"}).info.block_keys == salted
    assert not set(parse({**body, "cache_salt": "tenant-b"}).info.block_keys) & set(salted)


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


@pytest.mark.parametrize("field", ["ec_transfer_params", "routed_dp_rank", "disagg_prefill_dp_rank",
                                   "bootstrap_new_field", "disagg_anything", "lmcache_transfer_params"])
def test_every_transfer_field_at_the_top_level_is_the_routers(field):
    assert field in refused({"prompt": "a", field: {"x": 1}})
    assert field not in parse({"prompt": "a", field: {"x": 1}}, strip=True).body


@pytest.mark.parametrize("key", ["kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode"])
@pytest.mark.parametrize("value", ["", 0, [], "full", [1, 2]])
def test_transfer_keys_smuggled_through_vllm_xargs(key, value):
    # vLLM copies vllm_xargs into extra_args and reads these keys back from there: a falsy value
    # reached NIXL's scheduler code as kv_transfer_params
    body = {"prompt": "a", "vllm_xargs": {key: value, "my_extension": 3}}
    assert f"vllm_xargs.{key}" in refused(msgspec.json.decode(msgspec.json.encode(body)))
    for kind, extra in (("completion", {}), ("chat", {"messages": [{"role": "user", "content": "a"}]})):
        stripped = parse({**msgspec.json.decode(msgspec.json.encode(body)), **extra}, kind=kind,
                         strip=True).body
        assert stripped["vllm_xargs"] == {"my_extension": 3}


def test_a_legs_body_is_the_clients_own_json_with_the_routers_fields_spliced_in():
    # the client's bytes as sent (an escape, spacing, a trailing newline): kept, the prompt not
    # encoded again
    raw = b'{ "prompt" : "caf\\u00e9 \\"quoted\\"",\n "max_tokens": 4, "stream": false }\n'
    request = parse(None, raw=raw)
    assert request.raw == raw and request.body_with() == raw
    params = {"remote_engine_id": "p0", "remote_block_ids": [1, 2]}
    leg = request.body_with({"kv_transfer_params": params, "bootstrap_room": 7})
    assert leg.startswith(raw[:raw.rindex(b"}")])  # the client's bytes, then the router's fields
    assert msgspec.json.decode(leg) == {"prompt": 'caf\u00e9 "quoted"', "max_tokens": 4,
                                        "stream": False, "kv_transfer_params": params,
                                        "bootstrap_room": 7}


def test_a_body_passed_on_as_sent_reads_as_the_router_checked_it_even_with_a_name_twice():
    import json
    raw = b'{"prompt": "a", "max_tokens": 100000, "max_tokens": 4, "prompt": "b"}'
    request = parse(None, raw=raw)
    assert request.body_with() == raw and request.body["max_tokens"] == 4
    assert json.loads(request.body_with()) == request.body  # (the engines' reading: the last)


@pytest.mark.parametrize("raw, prompt", [
    (b'{"prompt": ["hello"], "max_tokens": 4}', "hello"),  # a batch of one, unwrapped
    (b'{"prompt": [[1, 2, 3]], "max_tokens": 4}', [1, 2, 3]),
])
def test_a_prompt_the_router_unwrapped_is_sent_as_checked_not_as_the_client_sent_it(raw, prompt):
    request = parse(None, raw=raw)
    assert request.raw is None and request.body["prompt"] == prompt
    assert request.body_with({"kv_transfer_params": {"x": 1}})["prompt"] == prompt


def test_transfer_fields_under_a_repeated_vllm_xargs_never_reach_a_leg():
    # the router reads the last vllm_xargs (null); a parser that kept the first would find
    # kv_transfer_params in it: such a body is encoded from what was checked, never sent as is
    raw = (b'{"prompt": "hi", "vllm_xargs": {"kv_transfer_params": {"remote_block_ids": [1]}}, '
           b'"vllm_xargs": null}')
    for strip in (False, True):
        request = parse(None, raw=raw, strip=strip)
        assert request.raw is None
        assert b"remote_block_ids" not in msgspec.json.encode(request.body_with({"bootstrap_room": 1}))


@pytest.mark.parametrize("body", [
    {"prompt": "a", "kv_transfer_params": {"remote_block_ids": [1]}},  # stripped: the body changed
    {"prompt": "a", "vllm_xargs": {"my_extension": 3}},  # nested names: encoded from what was checked
    {"prompt": "a", "unknown_field": 1},  # not a client field the router knows
])
def test_a_body_not_exactly_the_clients_known_fields_is_encoded_from_what_was_checked(body):
    request = parse(dict(body), strip=True)
    assert request.raw is None
    assert request.body_with() is request.body
    assert request.body_with({"kv_transfer_params": {"x": 1}}) == {**request.body,
                                                                 "kv_transfer_params": {"x": 1}}
    assert "remote_block_ids" not in str(request.body_with({"bootstrap_room": 1}))


@pytest.mark.parametrize("xargs", [[1], "x", 5, {"k": {"nested": 1}}, {"k": [1, [2]]}, {"k": None},
                                   {"k": [{"a": 1}]}, {"k": 2**64}, {"k": [-(2**63) - 1]}])
def test_vllm_xargs_must_follow_vllms_schema(xargs):
    assert "vllm_xargs" in refused({"prompt": "a", "vllm_xargs": xargs})


def test_vllm_xargs_of_scalars_pass_through():
    xargs = {"a": "s", "b": 1, "c": 2.5, "d": ["x", 1, 2.0], "e": True, "f": 2**64 - 1}
    assert parse({"prompt": "a", "vllm_xargs": dict(xargs)}).body["vllm_xargs"] == xargs


@pytest.mark.parametrize("depth", [65, 999, 5000])
def test_deeply_nested_json_is_a_400(depth):
    raw = b'{"prompt": "a", "x": ' + b"[" * depth + b"]" * depth + b"}"
    assert "nested deeper than 64" in refused(None, raw=raw)


def test_nesting_within_the_limit_passes_and_bracket_heavy_bodies_are_fine():
    raw = b'{"prompt": "a", "x": ' + b"[" * 62 + b"]" * 62 + b"}"
    assert parse(None, raw=raw).body["prompt"] == "a"
    parse({"prompt": "[" * 500 + "{" * 500})  # brackets inside a string nest nothing


@pytest.mark.parametrize("square", range(0, 66, 5))
def test_the_bracket_count_that_decides_on_the_walk_counts_both_kinds_to_the_limit(square):
    from pd_plugins.routers.request import MAX_JSON_DEPTH, _brackets_past_depth
    for curly in {0, 1, max(0, MAX_JSON_DEPTH - square), MAX_JSON_DEPTH - square + 1, 200}:
        raw = b'"x"'.join([b"["] * square + [b"{"] * curly) + b" trailing"
        assert _brackets_past_depth(raw) == (square + curly > MAX_JSON_DEPTH)


def test_numbers_out_of_range_are_a_400():
    assert "not valid JSON" in refused(None, raw=b'{"prompt": "a", "temperature": 1e999}')


def test_a_nested_batch_of_one_is_unwrapped_once():
    assert parse({"prompt": [[1, 2, 3]]}).info.prompt_tokens == 3
    assert "string or a list of token ids" in refused({"prompt": [[[1, 2, 3]]]})
    assert "string or a list of token ids" in refused(None, raw=b'{"prompt": ' + b"[" * 60 + b"]" * 60 + b"}")


@pytest.mark.parametrize("part, words", [({"type": "text", "text": 5}, "content[0].text"),
                                         ({"type": "text", "text": ["a"]}, "content[0].text"),
                                         (7, "content[0] must be"), ([{"text": "a"}], "content[0] must be")])
def test_chat_content_parts_must_be_well_formed(part, words):
    assert words in refused({"messages": [{"role": "user", "content": [part]}]}, kind="chat")


def test_chat_content_parts_as_strings_and_objects_count_as_text():
    req = parse({"messages": [{"role": "user", "content": ["x" * 40, {"type": "text", "text": "y" * 40},
                                                          {"type": "image_url", "image_url": {"url": "u"}}]}]},
                kind="chat")
    assert req.info.prompt_tokens == 20


@pytest.mark.parametrize("value", ["a" * 129, "bad\x00id", "tab\tid", "caf\u00e9",
                                   b"\xff\xfe".decode("utf-8", "surrogateescape")])
def test_bad_client_request_ids_are_a_400(value):
    assert "X-Request-Id" in refused({"prompt": "a"}, headers={"X-Request-Id": value})


def test_good_client_request_ids_pass():
    parse({"prompt": "a"}, headers={"X-Request-Id": "trace-1234 abc/DEF:9"})
    parse({"prompt": "a"}, headers={"X-Request-Id": "a" * 128})


def test_both_token_limits_are_checked_whichever_the_engine_reads():
    # a completion's max_completion_tokens, or a chat's max_tokens beside max_completion_tokens
    assert "'max_completion_tokens' must be" in refused({"prompt": "a", "max_completion_tokens": "x"})
    chat = {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 5, "max_tokens": "abc"}
    assert "'max_tokens' must be" in refused(chat, kind="chat")
    chat = {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": None, "max_tokens": 4}
    assert parse(chat, kind="chat").info.max_tokens == 4


def test_the_fields_taken_as_plain_client_fields_are_no_transfer_fields():
    # CLIENT_FIELDS lets a body skip the per-field test: none of them may be one the router owns
    from pd_plugins.routers.request import CLIENT_FIELDS, _is_transfer_field
    assert not [name for name in CLIENT_FIELDS if _is_transfer_field(name)]


def test_what_the_decode_would_refuse_after_the_prefill_ran_is_refused_here():
    # the prefill's one-token leg drops stream_options and min_tokens: vLLM refused these only
    # on the decode leg, after the prefill had run (and held the prompt's KV)
    assert "stream_options" in refused({"prompt": "a", "stream_options": {"include_usage": True}})
    assert "stream_options" in refused({"prompt": "a", "stream": False,
                                        "stream_options": {"include_usage": True}})
    parse({"prompt": "a", "stream": True, "stream_options": {"include_usage": True}})
    parse({"prompt": "a", "stream_options": {}})  # vLLM lets an empty one through
    assert "'min_tokens' = 9 is more than 'max_tokens' = 5" in refused(
        {"prompt": "a", "max_tokens": 5, "min_tokens": 9})
    assert "'max_completion_tokens' = 5" in refused(
        {"messages": [{"role": "user", "content": "a"}], "max_tokens": 50,
         "max_completion_tokens": 5, "min_tokens": 9}, kind="chat")
    for bad in (-1, "3", True, 1.5):
        assert "'min_tokens' must be" in refused({"prompt": "a", "min_tokens": bad})
    parse({"prompt": "a", "max_tokens": 5, "min_tokens": 5})
    # a completion without max_tokens gets the engines' default, 16 (vLLM's CompletionRequest)
    assert "'max_tokens' = 16 (the default)" in refused({"prompt": [1, 2, 3], "min_tokens": 20})
    parse({"prompt": [1, 2, 3], "min_tokens": 16})
    # and the context must hold the prompt and those 16, as the engine checks
    assert "plus 16 to generate" in refused({"prompt": list(range(500))})
    parse({"prompt": list(range(496))})


def test_parallel_sampling_is_marked_to_be_served_on_the_decode_alone():
    assert not parse({"prompt": "a"}).fan_out and not parse({"prompt": "a", "n": 1}).fan_out
    assert parse({"prompt": "a", "n": 2}).fan_out
    assert not parse({"prompt": "a", "best_of": 3}).fan_out  # vLLM 0.32's completions ignore it
    assert parse({"prompt": "a", "use_beam_search": True}).fan_out


def test_long_text_prompts_are_tokenized_off_the_event_loop(tmp_path):
    """A tokenizer holds the loop about 1.5 ms per thousand characters (a 3 MiB prompt: 4 s):
    parse_request leaves a long prompt to tokenize_deferred, which tokenizes it on a thread
    that releases the GIL, and refuses one whose length alone overflows the context at once."""
    import asyncio
    import time

    from pd_plugins.routers.request import INLINE_TOKENIZE_CHARS, tokenize_deferred
    from pd_plugins.routers.tokenizer import load_tokenizer
    from tests.unit.routers.helpers import build_tokenizer

    tokenize = load_tokenizer(build_tokenizer(tmp_path))
    assert tokenize.max_token_chars and tokenize.max_token_chars < 64

    def parse_text(text, max_model_len):
        return parse_request(msgspec.json.encode({"prompt": text, "max_tokens": 5}), "completion",
                             {}, strip_transfer_fields=False, select_model=serving(
                                 Target(max_model_len, key_block_size=4, tokenize=tokenize)))

    short = parse_text("the lazy dog " * 10, 1 << 20)
    assert short.deferred is None and short.info.prompt_tokens == len(tokenize("the lazy dog " * 10))

    text = "the quick brown fox jumps over the lazy dog " * 20_000  # 880k characters
    started = time.perf_counter()
    with pytest.raises(BadRequest, match="at least"):  # by its length: no tokenizing
        parse_text(text, 8192)
    assert time.perf_counter() - started < 0.05

    request = parse_text(text, 1 << 20)  # fits a long context: tokenized later, off the loop
    assert request.deferred is not None and len(text) > INLINE_TOKENIZE_CHARS

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1
        ticker = asyncio.create_task(tick())
        started = time.perf_counter()
        await tokenize_deferred(request)
        took = time.perf_counter() - started
        ticker.cancel()
        return ticks, took

    ticks, took = asyncio.run(main())
    assert ticks > took * 200, (ticks, took)  # the loop ran on (1 ms ticks) while it tokenized
    tokens = tokenize(text)
    info = request.info
    assert info.prompt_tokens == len(tokens) and info.prompt == tokens and info.exact_tokens
    assert info.block_keys == block_keys(tokens, 4) and request.deferred is None
    tight = parse_text(text, len(tokens) + 3)  # passes the length bound, not the context
    with pytest.raises(BadRequest, match=f"prompt of {len(tokens)} tokens plus 5"):
        asyncio.run(tokenize_deferred(tight))
