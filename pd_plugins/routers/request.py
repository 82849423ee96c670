"""Turn a client's OpenAI request into a checked body plus what the policies need to know.

Cheap checks only (the engine validates the rest and its 4xx is passed through): the body is a JSON
object, the prompt or messages are there and well-formed, max_tokens is sane, the model is served.
`block_size=None` skips the prefix block keys (no policy piece reads them).
Transfer fields (`kv_transfer_params`, `bootstrap_*`) are the router's alone: a client that sends
them is refused or has them removed (`client_transfer_fields`), so it can never point a decode at
KV blocks it does not own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import msgspec

from pd_plugins.routers.policy.base import RequestInfo
from pd_plugins.routers.policy.prefix_index import block_keys, text_block_keys

TRANSFER_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                   "bootstrap_pair_key", "disagg_prefill_dp_rank", "data_parallel_rank")
SESSION_HEADERS = ("x-session-id", "x-conversation-id", "x-user-id")
SESSION_FIELDS = ("session_id", "user")  # body fields, after the headers
MAX_SESSION_ID = 128
CHARS_PER_TOKEN = 4  # estimate for text prompts without a tokenizer

Kind = Literal["completion", "chat"]
Tokenize = Callable[[str], list[int]]


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class ClientRequest:
    kind: Kind
    body: dict[str, Any]
    info: RequestInfo

    @property
    def stream(self) -> bool:
        return self.info.stream

    @property
    def model(self) -> str | None:
        return self.body.get("model")


_decoder = msgspec.json.Decoder()


def parse_request(raw: bytes, kind: Kind, headers: Any, *, served_models: set[str],
                  max_model_len: int | None, block_size: int | None, strip_transfer_fields: bool,
                  tokenize: Tokenize | None = None) -> ClientRequest:
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")

    for name in TRANSFER_FIELDS:
        if name in body:
            if not strip_transfer_fields:
                raise BadRequest(400, f"'{name}' is set by the router and may not come from a "
                                      "client", param=name)
            del body[name]

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(400, "'model' must be a string", param="model")
    if model is not None and served_models and model not in served_models:
        raise BadRequest(404, f"model {model!r} is not served here; available: "
                              f"{', '.join(sorted(served_models))}", param="model")

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "'stream' must be true or false", param="stream")

    limit_key = "max_completion_tokens" if kind == "chat" and "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(limit_key)
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest(400, f"'{limit_key}' must be a positive integer (got {max_tokens!r})",
                             param=limit_key)
        if max_model_len is not None and max_tokens >= max_model_len:
            raise BadRequest(400, f"'{limit_key}' = {max_tokens} does not fit the model's "
                                  f"context of {max_model_len} tokens", param=limit_key)

    tokens, text = (_completion_prompt(body) if kind == "completion" else _chat_prompt(body))
    exact = tokens is not None or (tokenize is not None and kind == "completion")
    if tokens is None and tokenize is not None:
        tokens = tokenize(text)  # chat: the rendered messages, a close estimate of the template
    if tokens is not None:
        prompt_tokens = len(tokens)
        keys = block_keys(tokens, block_size) if block_size else []
    else:
        prompt_tokens = max(1, len(text) // CHARS_PER_TOKEN)
        keys = text_block_keys(text, block_size, CHARS_PER_TOKEN) if block_size else []
    if exact and max_model_len is not None and prompt_tokens + (max_tokens or 1) > max_model_len:
        raise BadRequest(400, f"prompt of {prompt_tokens} tokens plus {max_tokens or 1} to generate "
                              f"exceeds the model's context of {max_model_len} tokens", param="prompt")

    session = _session_id(headers, body)
    info = RequestInfo(prompt_tokens=prompt_tokens, block_keys=keys, max_tokens=max_tokens,
                       stream=stream, session_id=session, exact_tokens=exact)
    return ClientRequest(kind, body, info)


def _session_id(headers: Any, body: dict) -> str | None:
    """The conversation's id from the first header or body field that has one: trimmed, at most
    MAX_SESSION_ID printable ASCII characters (a 400 otherwise, never a silent truncation)."""
    for source, name, value in [*(("header", h, headers.get(h)) for h in SESSION_HEADERS),
                                *(("field", f, body.get(f)) for f in SESSION_FIELDS)]:
        if value is None:
            continue
        if not isinstance(value, str):
            raise BadRequest(400, f"'{name}' must be a string", param=name)
        value = value.strip()
        if not value:
            continue
        if len(value) > MAX_SESSION_ID or not value.isascii() or not value.isprintable():
            raise BadRequest(400, f"session id in {source} '{name}' must be at most {MAX_SESSION_ID} "
                                  "printable ASCII characters", param=name)
        return value
    return None


def _completion_prompt(body: dict) -> tuple[list[int] | None, str]:
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest(400, "'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest(400, "'prompt' is empty", param="prompt")
        return None, prompt
    # set(map(type)) and min() run in C: a 2k-token prompt costs the router ~20 us, not ~100
    if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int}:
        if min(prompt) < 0:
            raise BadRequest(400, "'prompt' token ids must be >= 0", param="prompt")
        return prompt, ""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[0]
        return _completion_prompt(body)
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
            parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        elif content is not None:
            raise BadRequest(400, f"messages[{i}].content must be a string or a list of parts",
                             param="messages")
    return None, "".join(parts)
