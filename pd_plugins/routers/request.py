"""Turn a client's OpenAI request into a checked body plus what the policies need to know.

Cheap checks only (the engine validates the rest and its 4xx is passed through): the body is a JSON
object nested at most MAX_JSON_DEPTH deep, the prompt or messages are there and well-formed,
max_tokens is sane, the model is served, a client's X-Request-Id is short printable ASCII.
`block_size=None` skips the prefix block keys (no policy piece reads them).
Transfer fields are the router's alone, wherever they hide: top level (`kv_transfer_params`,
`ec_transfer_params`, SGLang's `bootstrap_*`, `disagg_*` and DP-rank fields) and inside
`vllm_xargs`, which vLLM copies into SamplingParams.extra_args and reads `kv_transfer_params`,
`ec_transfer_params` and `kv_cache_report_mode` back from (vllm/v1/request.py). A client that sends
one is refused or has it removed (`client_transfer_fields`), so it can never point a decode at KV
blocks it does not own, nor hand an engine a malformed one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Literal, NoReturn, Protocol, Union

import msgspec

from pd_plugins.routers.policy.base import RequestInfo
from pd_plugins.vocab.block_keys import block_keys, prompt_root, text_block_keys

TRANSFER_FIELDS = ("kv_transfer_params", "ec_transfer_params", "bootstrap_host", "bootstrap_port",
                   "bootstrap_room", "bootstrap_pair_key", "disagg_prefill_dp_rank",
                   "data_parallel_rank", "routed_dp_rank", "kv_cache_report_mode")
# SGLang's PD fields, also ones a later version adds; any *_transfer_params (vLLM's connectors)
TRANSFER_PREFIXES = ("bootstrap_", "disagg_")
TRANSFER_SUFFIX = "_transfer_params"
# OpenAI and vLLM request fields that are none of the above: a body of only these (nearly every
# request) is checked with one subset test (in C), not a test per field
CLIENT_FIELDS = frozenset((
    "model", "prompt", "messages", "suffix", "max_tokens", "max_completion_tokens", "min_tokens",
    "temperature", "top_p", "top_k", "min_p", "n", "best_of", "stream", "stream_options", "stop",
    "stop_token_ids", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logprobs", "top_logprobs", "logit_bias", "echo", "user", "session_id", "ignore_eos",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "vllm_xargs",
    "skip_special_tokens", "include_stop_str_in_output", "chat_template_kwargs",
    "add_generation_prompt", "priority", "request_id"))
MAX_JSON_DEPTH = 64  # far deeper than any OpenAI request (tool schemas nest a few levels)
MAX_REQUEST_ID = 128
XARGS_INT_RANGE = (-(2**63), 2**64)  # vLLM's extra_args travel as MessagePack integers
SESSION_HEADERS = ("x-session-id", "x-conversation-id", "x-user-id")
SESSION_FIELDS = ("session_id", "user")  # body fields, after the headers
_SESSION_KEYS = frozenset(name.encode() for name in SESSION_HEADERS)
_SESSION_FIELD_SET = frozenset(SESSION_FIELDS)
MAX_SESSION_ID = 128
CHARS_PER_TOKEN = 4  # estimate for text prompts without a tokenizer
# A text prompt longer than this (characters) is tokenized on a worker thread (tokenize_deferred),
# not on the event loop: a tokenizer takes about 1.5 ms per thousand characters, holding the loop
INLINE_TOKENIZE_CHARS = 4096
COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens

Kind = Literal["completion", "chat"]
Tokenize = Callable[[str], list[int]]


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class ModelTarget(Protocol):
    """Where a request's `model` leads (server.py's model groups): that model's limits."""

    max_model_len: int | None
    key_block_size: int | None
    tokenize: Tokenize | None
    adapter_parents: dict[str, str]  # LoRA adapter -> its base model, from the workers


# A leg's body: a dict, encoded as the leg is sent, or JSON made already (ClientRequest.body_with).
LegBody = Union[dict[str, Any], bytes]


@dataclass
class ClientRequest:
    kind: Kind
    body: dict[str, Any]
    info: RequestInfo
    target: Any = None  # the ModelTarget select_model chose
    # parallel sampling (n past 1, beam search): the engine fans it out into requests
    # that share one kv_transfer_params, so it is served on the decode alone (proxy.py)
    fan_out: bool = False
    # a long text prompt to tokenize off the event loop before the request is served
    # (tokenize_deferred): (text, block-key root, tokens to generate at least, exact)
    deferred: tuple | None = None
    client_id: str | None = None  # the client's X-Request-Id (checked: short printable ASCII)
    # the client's JSON as it came, where the body checked is what it reads as: client fields
    # only (CLIENT_FIELDS), no vllm_xargs (whose nested names are checked, and which a repeated
    # key could hide), and a prompt as sent (not a batch of one, unwrapped). What body_with builds
    # legs' bodies from.
    raw: bytes | None = None

    def body_with(self, fields: dict[str, Any] | None = None) -> LegBody:
        """The client's body with the router's `fields` added (names no client may send: with
        `raw` set the body has none of them). From `raw`, the client's own bytes with the fields
        spliced in before its closing brace, so the prompt is not encoded again (a cost that grows
        with the prompt); else a dict."""
        raw = self.raw
        if raw is None:
            return {**self.body, **fields} if fields else self.body
        if not fields:
            return raw
        # (a JSON object ends with its brace and maybe whitespace; a request has a prompt, so the
        # object is not empty and the fields follow a comma)
        return b"%b,%b" % (raw[:raw.rindex(b"}")], _encode(fields)[1:])

    @property
    def stream(self) -> bool:
        return self.info.stream

    @property
    def model(self) -> str | None:
        return self.body.get("model")


_decoder = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode


def leg_json(body: LegBody) -> bytes:
    """A leg's body as the bytes sent."""
    return body if type(body) is bytes else _encode(body)


def leg_dict(body: LegBody) -> dict[str, Any]:
    """A leg's body as a dict (made by body_with as bytes: decoded)."""
    return _decoder.decode(body) if isinstance(body, bytes) else body


def parse_request(raw: bytes, kind: Kind, headers: Any, *,
                  select_model: Callable[[str | None], ModelTarget],
                  strip_transfer_fields: bool) -> ClientRequest:
    """`select_model` maps the request's `model` to its target (server.py: its model group),
    raising BadRequest for a model not served; the target's context length, block size and
    tokenizer then check and key the prompt."""
    try:
        body = _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # e.g. 1e999: out of range
        raise BadRequest(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    if _brackets_past_depth(raw):  # (only then can it nest that deep)
        _check_depth(body)
    client_id = _request_id(headers)
    only_client_fields = CLIENT_FIELDS.issuperset(body)
    if not only_client_fields:  # nearly every request has client fields only: none looked at alone
        _remove_transfer_fields(body, "", strip_transfer_fields)
    get = body.get
    xargs = get("vllm_xargs")
    if xargs is not None:
        if not isinstance(xargs, dict):
            raise BadRequest(400, "'vllm_xargs' must be an object", param="vllm_xargs")
        _remove_transfer_fields(xargs, "vllm_xargs.", strip_transfer_fields)
        _check_xargs(xargs)

    model = get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(400, "'model' must be a string", param="model")
    target = select_model(model)
    max_model_len, block_size, tokenize = target.max_model_len, target.key_block_size, target.tokenize

    stream = get("stream", False)
    if stream is not False and stream is not True:
        raise BadRequest(400, "'stream' must be true or false", param="stream")
    # what an engine refuses on the decode leg after the prefill ran (the prefill's one-token leg
    # drops stream_options and min_tokens): vLLM's validators, checked here for nothing
    if not stream and get("stream_options"):
        raise BadRequest(400, "'stream_options' can only be set with 'stream': true",
                         param="stream_options")

    # both checked: an engine may read either (a JSON integer is an int, never a subclass but
    # bool, which `type(...) is int` leaves out)
    max_tokens, max_completion = get("max_tokens"), get("max_completion_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        _not_positive("max_tokens", max_tokens)
    if max_completion is not None and (type(max_completion) is not int or max_completion < 1):
        _not_positive("max_completion_tokens", max_completion)
    limit_key = "max_tokens"
    if kind == "chat" and max_completion is not None:
        limit_key, max_tokens = "max_completion_tokens", max_completion
    if max_tokens is not None:
        if max_model_len is not None and max_tokens >= max_model_len:
            raise BadRequest(400, f"'{limit_key}' = {max_tokens} does not fit the model's "
                                  f"context of {max_model_len} tokens", param=limit_key)
    # the engine's limit: a completion without one gets 16 (vLLM's CompletionRequest, OpenAI's)
    limit = (max_tokens if max_tokens is not None
             else COMPLETION_MAX_TOKENS if kind == "completion" else None)
    min_tokens = get("min_tokens")
    if min_tokens is not None:
        if type(min_tokens) is not int or min_tokens < 0:
            raise BadRequest(400, f"'min_tokens' must be an integer >= 0 (got {_short(min_tokens)})",
                             param="min_tokens")
        if limit is not None and min_tokens > limit:
            shown = f"'{limit_key}' = {limit}" + ("" if max_tokens is not None else " (the default)")
            raise BadRequest(400, f"'min_tokens' = {min_tokens} is more than {shown}",
                             param="min_tokens")
    need = limit or max(min_tokens or 0, 1)  # the fewest tokens it may generate in context

    # a LoRA adapter's prompt blocks are keyed apart from the base model's and other adapters',
    # and a cache_salt's apart from every other salt's (vLLM's own block hashes do both)
    adapter = model if model in target.adapter_parents else None
    salt = get("cache_salt")
    root = prompt_root(adapter, salt if isinstance(salt, str) else None)
    sent_prompt = get("prompt")
    tokens, text = (_completion_prompt(body) if kind == "completion" else _chat_prompt(body))
    exact = tokens is not None or (tokenize is not None and kind == "completion")
    deferred = None
    if tokens is None and tokenize is not None:
        if len(text) <= INLINE_TOKENIZE_CHARS:
            tokens = tokenize(text)  # chat: the rendered messages, a close estimate of the template
        else:  # tokenized off the loop (tokenize_deferred), unless its length alone refuses it
            if exact and max_model_len is not None:
                _refuse_by_length(text, tokenize, need, max_model_len)
            deferred = (text, root, need, exact)
    if tokens is not None:
        prompt_tokens = len(tokens)
        keys = block_keys(tokens, block_size, root) if block_size else []
    elif deferred is not None:  # filled in by tokenize_deferred
        prompt_tokens, keys = max(1, len(text) // CHARS_PER_TOKEN), []
    else:
        prompt_tokens = max(1, len(text) // CHARS_PER_TOKEN)
        keys = text_block_keys(text, block_size, CHARS_PER_TOKEN, root) if block_size else []
    if exact and max_model_len is not None and prompt_tokens + need > max_model_len \
            and deferred is None:
        raise BadRequest(400, f"prompt of {prompt_tokens} tokens plus {need} to generate "
                              f"exceeds the model's context of {max_model_len} tokens", param="prompt")

    session = _session_id(headers, body)
    info = RequestInfo(prompt_tokens=prompt_tokens, block_keys=keys, max_tokens=max_tokens,
                       stream=stream, session_id=session, exact_tokens=exact, adapter=adapter,
                       prompt=tokens if tokens is not None else text,
                       block_width=(block_size or 0) * (1 if tokens is not None else CHARS_PER_TOKEN))
    n = get("n")  # (vLLM 0.32's completions take no best_of: it is ignored there)
    fan_out = (n is not None and n != 1) or bool(get("use_beam_search"))
    return ClientRequest(kind, body, info, target, fan_out, deferred, client_id,
                         raw if only_client_fields and "vllm_xargs" not in body
                         and get("prompt") is sent_prompt else None)


def _not_positive(key: str, value: Any) -> NoReturn:
    raise BadRequest(400, f"'{key}' must be a positive integer (got {_short(value)})", param=key)


def _refuse_by_length(text: str, tokenize: Tokenize, need: int, max_model_len: int) -> None:
    """A prompt whose characters alone need more tokens than the context holds (tokenizer.py:
    max_token_chars, where that bound is sure) is refused without being tokenized."""
    bound = getattr(tokenize, "max_token_chars", None)
    if not bound:
        return
    fewest = -(-len(text) // bound)
    if fewest + need > max_model_len:
        raise BadRequest(400, f"prompt of at least {fewest} tokens ({len(text)} characters, at most "
                              f"{bound} a token) plus {need} to generate exceeds the model's context "
                              f"of {max_model_len} tokens", param="prompt")


async def tokenize_deferred(request: ClientRequest) -> None:
    """A long text prompt parse_request left untokenized: its tokens and block keys computed on a
    worker thread (the tokenizer's off_loop releases the GIL), then checked against the context
    and filled into request.info as parse_request would have. BadRequest as parse_request's."""
    assert request.deferred is not None  # (the caller's test)
    text, root, need, exact = request.deferred
    request.deferred = None
    target = request.target
    block_size, max_model_len = target.key_block_size, target.max_model_len
    tokenize = getattr(target.tokenize, "off_loop", target.tokenize)

    def work() -> tuple[list[int], list[int]]:
        tokens = tokenize(text)
        return tokens, block_keys(tokens, block_size, root) if block_size else []

    tokens, keys = await asyncio.to_thread(work)
    if exact and max_model_len is not None and len(tokens) + need > max_model_len:
        raise BadRequest(400, f"prompt of {len(tokens)} tokens plus {need} to generate "
                              f"exceeds the model's context of {max_model_len} tokens", param="prompt")
    info = request.info
    info.prompt_tokens, info.block_keys, info.prompt = len(tokens), keys, tokens
    info.block_width = block_size or 0


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _is_transfer_field(name: str) -> bool:
    return name in TRANSFER_FIELDS or name.startswith(TRANSFER_PREFIXES) or name.endswith(TRANSFER_SUFFIX)


def _remove_transfer_fields(fields: dict, where: str, strip: bool) -> None:
    for name in [k for k in fields if k not in CLIENT_FIELDS and _is_transfer_field(k)]:
        if not strip:
            raise BadRequest(400, f"'{where}{name}' is set by the router and may not come from a "
                                  "client", param=where + name)
        del fields[name]


def _check_xargs(xargs: dict) -> None:
    """vLLM's schema: each value a string or number, or a list of them (a 400 here, not from the
    engine after a prefill leg ran)."""
    for key, value in xargs.items():
        for item in value if isinstance(value, list) else (value,):
            if not isinstance(item, (str, int, float)):
                raise BadRequest(400, f"'vllm_xargs.{key}' must be a string or a number, or a list "
                                      "of them", param=f"vllm_xargs.{key}")
            if isinstance(item, int) and not XARGS_INT_RANGE[0] <= item < XARGS_INT_RANGE[1]:
                raise BadRequest(400, f"'vllm_xargs.{key}' holds an integer out of the 64-bit "
                                      "range", param=f"vllm_xargs.{key}")


def _brackets_past_depth(raw: bytes) -> bool:
    """Whether `raw` has more than MAX_JSON_DEPTH opening brackets, the fewest a body nested
    deeper has. Found with find(), which skips to each at memchr's speed, and counted only to the
    limit: bytes.count() reads a byte at a time (about 30 µs for a 32 KB prompt)."""
    seen, find = 0, raw.find
    for bracket in (b"[", b"{"):
        at = find(bracket)
        while at >= 0:
            seen += 1
            if seen > MAX_JSON_DEPTH:
                return True
            at = find(bracket, at + 1)
    return False


def _check_depth(body: dict) -> None:
    """Refuse a body nested deeper than MAX_JSON_DEPTH. Only one with that many brackets can:
    parse_request looks for them first (_brackets_past_depth), so a normal request never pays for
    the walk."""
    level: list[Any] = [body]
    depth = 1
    while level:
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        depth += 1


def short_printable_ascii(value: str, limit: int) -> bool:
    return len(value) <= limit and value.isascii() and value.isprintable()


def _request_id(headers: Any) -> str | None:
    """A client's X-Request-Id, which goes into the legs' ids and logs: short printable ASCII
    only (a header that is not UTF-8 arrives here with surrogates, which are not ASCII)."""
    value = headers.get("X-Request-Id")
    if value and not short_printable_ascii(value, MAX_REQUEST_ID):
        raise BadRequest(400, f"X-Request-Id must be at most {MAX_REQUEST_ID} printable ASCII "
                              "characters", param="X-Request-Id")
    return value or None


def _session_id(headers: Any, body: dict) -> str | None:
    """The conversation's id from the first header or body field that has one: trimmed, at most
    MAX_SESSION_ID printable ASCII characters (a 400 otherwise, never a silent truncation)."""
    has_any = getattr(headers, "has_any", None)  # the front server's (http_server.RequestHeaders)
    if (has_any is not None and not has_any(_SESSION_KEYS)
            and _SESSION_FIELD_SET.isdisjoint(body)):
        return None  # most requests: no name looked up one by one
    for source, names, where in (("header", SESSION_HEADERS, headers), ("field", SESSION_FIELDS, body)):
        for name in names:
            value = where.get(name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise BadRequest(400, f"'{name}' must be a string", param=name)
            value = value.strip()
            if not value:
                continue
            if not short_printable_ascii(value, MAX_SESSION_ID):
                raise BadRequest(400, f"session id in {source} '{name}' must be at most "
                                      f"{MAX_SESSION_ID} printable ASCII characters", param=name)
            return value
    return None


def _completion_prompt(body: dict) -> tuple[list[int] | None, str]:
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest(400, "'prompt' is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = body["prompt"] = prompt[0]  # a batch of one: unwrapped once, never recursively
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest(400, "'prompt' is empty", param="prompt")
        return None, prompt
    # set(map(type)) and min() run in C: a 2k-token prompt costs the router ~20 us, not ~100
    if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int}:
        if min(prompt) < 0:
            raise BadRequest(400, "'prompt' token ids must be >= 0", param="prompt")
        return prompt, ""
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest(400, "batched prompts are not supported by PD serving: send one prompt "
                              "per request", param="prompt")
    raise BadRequest(400, "'prompt' must be a string or a list of token ids", param="prompt")


def _chat_prompt(body: dict) -> tuple[None, str]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "'messages' must be a non-empty list", param="messages")
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            parts.append(f"{message['role']}: {content}\n")
        elif isinstance(content, list):
            parts.extend(_text_parts(content, i))
        elif content is not None:
            raise BadRequest(400, f"messages[{i}].content must be a string or a list of parts",
                             param="messages")
    return None, "".join(parts)


def _text_parts(content: list, i: int) -> list[str]:
    """The text of a message's content parts (vLLM takes a part as a string or an object; an
    object's `text`, when there, is a string)."""
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict):
            text = part.get("text")
            if text is not None and not isinstance(text, str):
                raise BadRequest(400, f"messages[{i}].content[{j}].text must be a string",
                                 param="messages")
            texts.append(text or "")
        else:
            raise BadRequest(400, f"messages[{i}].content[{j}] must be a string or an object",
                             param="messages")
    return texts
