"""The mock engine's own HTTP extensions, as its clients (the replay, tests, benchmarks) read them.

A leaf beside the mock: no aiohttp, no engine model, so a client reads the mock's answers without
importing the mock itself.

- `GET /mock/stats`: counters (what it served) and, with --latency-model, the model's own;
- `GET /mock/timings` (--latency-model only): one `LegTiming` per leg that made its first token;
- `GET /mock/bodies`: the last request bodies it received; `POST /mock/faults`: change faults;
- `mock_output_ids` in a request body: the tokens a turn "generates" (a modelled mock caches the
  blocks they complete, as the next turn's prompt will hold them).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

STATS_PATH = "/mock/stats"
TIMINGS_PATH = "/mock/timings"
BODIES_PATH = "/mock/bodies"
FAULTS_PATH = "/mock/faults"
OUTPUT_IDS_KEY = "mock_output_ids"

_encode = msgspec.json.Encoder().encode


def prompt_digest(body: dict[str, Any]) -> str:
    """What names a prompt in the mock: its prefill registers it for the decode, its text is a
    function of it, and /mock/timings lists legs by it."""
    source = body.get("prompt") if "prompt" in body else body.get("messages")
    return hashlib.blake2b(_encode(source), digest_size=8).hexdigest()


class LegTiming(msgspec.Struct, frozen=True):
    """One leg in /mock/timings, in model seconds."""

    prompt: str           # prompt_digest of its body
    leg: str              # "prefill", "remote_decode" or "local"
    arrived_s: float      # when it reached the server
    first_token_s: float  # when the model made its first token
