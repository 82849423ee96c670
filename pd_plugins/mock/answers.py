"""What the mock reads from an OpenAI request and the answers it writes (no model runs).

Its text is a deterministic function of the prompt (its digest), so a test can tell a right
answer from a wrong one through any route.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from pd_plugins.mock.protocol import OUTPUT_IDS_KEY

WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "lambda", "sigma", "omega")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_encode = msgspec.json.Encoder().encode


# -- reading a request -------------------------------------------------------------------------
def prompt_tokens(body: dict[str, Any]) -> int:
    """Token ids count as they are; text counts ~4 characters a token."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return max(1, len(prompt) // 4)
    return max(1, len(_encode(body.get("messages", ""))) // 4)


def token_ids(body: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids, or None for a text prompt (which keys no cache blocks)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        return prompt
    return None


def output_ids(body: dict[str, Any]) -> list[int] | None:
    """The replay's `mock_output_ids` (perf.replay.request_body), if well formed."""
    ids = body.get(OUTPUT_IDS_KEY)
    if isinstance(ids, list) and all(type(t) is int for t in ids):
        return ids
    return None


def max_tokens(body: dict[str, Any]) -> Any:
    return body.get("max_completion_tokens") or body.get("max_tokens") or 16


# -- writing an answer -------------------------------------------------------------------------
def output_words(digest: str, count: int) -> list[str]:
    seed = int(digest, 16)
    return [WORDS[(seed >> (i % 61)) % len(WORDS) ^ (i % 3)] + " " for i in range(count)]


def completion(chat: bool, model: str, words: list[str], n_prompt: int,
               kv_transfer_params: dict | None = None) -> dict:
    text = "".join(words)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
              if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
    out = {"id": f"mock-{uuid.uuid4().hex[:12]}", "object": "chat.completion" if chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": [choice],
           "usage": usage(n_prompt, len(words))}
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def chunk(chat: bool, model: str, word: str, finish: str | None) -> dict:
    choice = ({"index": 0, "delta": {"content": word}, "finish_reason": finish} if chat
              else {"index": 0, "text": word, "logprobs": None, "finish_reason": finish})
    return {"id": "mock", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def usage(n_prompt: int, n_output: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_output,
            "total_tokens": n_prompt + n_output}


def event(payload: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + _encode(payload) + b"\n\n"


def json_answer(payload: dict) -> web.Response:
    return web.Response(body=_encode(payload), content_type="application/json")


def error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=_encode({"error": {"message": message, "code": status}}),
                        content_type="application/json")
