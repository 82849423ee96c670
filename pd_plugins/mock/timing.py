"""When the mock's legs make their tokens: one interface, two implementations.

- `FixedDelays` (this module): `--ttft-ms`, `--prefill-ms-per-token`, `--tpot-ms`; the KV moves
  at once, and nothing queues.
- `ModelledTiming` (modelled.py, `--latency-model`): the engine model of pd_plugins.perf on an
  accelerated clock (batching, prefix cache, bounded KV, KV transfer times).

The HTTP side (engine.py) does the same for both: it starts a `Run` per leg and writes tokens as
the run makes them.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["prefill", "remote_decode", "local"]


@dataclass(frozen=True)
class Work:
    """What a leg asks of the engine."""

    kind: Kind
    prompt_tokens: int
    output_tokens: int                     # a prefill leg: 1
    ids: list[int] | None = None           # the prompt's token ids (None: a text prompt)
    output_ids: list[int] | None = None    # what it "generates", when the client said so


class Run(ABC):
    """One leg on its way through the engine, as its handler waits on it."""

    made: int = 0                       # output tokens made so far
    done: bool = False                  # all made, failed or aborted
    error: str | None = None            # why it could not be served (HTTP 400)
    cached_tokens: int = 0              # prompt tokens found in the prefix cache
    first_token_at: float | None = None  # model time of its first token (None: not modelled)

    @abstractmethod
    async def progress(self) -> None:
        """Wait until `made` or `done` changes."""

    async def first_token(self) -> None:
        while not self.made and not self.done:
            await self.progress()

    async def finished(self) -> None:
        while not self.done:
            await self.progress()

    def abort(self) -> None:
        """Its client left: drop it (and whatever KV it holds)."""

    def release(self) -> None:
        """A prefill leg's KV was taken by its decode (or given up on)."""

    def kv_accepted(self) -> None:
        """A remote decode found the KV it pulled to be its prompt's."""


class Timing(ABC):
    # True: the KV transfer is part of a remote decode's time, so a pull starts at once and the
    # decode checks the KV at its first token; False: the decode takes the KV before it starts.
    times_kv_transfer: bool = False
    # Wall seconds a prefill keeps KV nobody took (None: until it is taken)
    unread_kv_hold_s: float | None = None
    # Its runs report model times (/mock/timings)
    modelled: bool = False

    @abstractmethod
    def start(self, work: Work, arrived: float | None = None) -> Run:
        """`arrived`: when the leg reached the server, on `now()`'s clock (None: now)."""

    def now(self) -> float:
        return 0.0

    async def open(self) -> None:
        """Start with the server."""

    async def close(self) -> None:
        """Stop with the server."""

    def load(self, handling: int) -> tuple[float, float, float]:
        """(waiting, running, KV usage) for /metrics; `handling`: requests the server handles."""
        return 0, handling, 0.0

    def stats(self) -> dict[str, Any]:
        """Its own part of /mock/stats."""
        return {}


class FixedDelays(Timing):
    """A fixed prefill time (plus a time per prompt token) and a fixed time per output token."""

    def __init__(self, ttft_ms: float, prefill_ms_per_token: float, tpot_ms: float) -> None:
        self.ttft_s, self.prefill_s_per_token, self.tpot_s = (
            ttft_ms / 1e3, prefill_ms_per_token / 1e3, tpot_ms / 1e3)

    def start(self, work: Work, arrived: float | None = None) -> Run:
        prefill_s = self.ttft_s + self.prefill_s_per_token * work.prompt_tokens
        if work.kind == "prefill":
            return FixedRun(prefill_s, 0.0, 1)
        first = self.tpot_s + (prefill_s if work.kind == "local" else 0.0)
        return FixedRun(first, self.tpot_s, work.output_tokens)


class FixedRun(Run):
    def __init__(self, first_token_s: float, tpot_s: float, tokens: int) -> None:
        self.first_token_s, self.tpot_s, self.tokens = first_token_s, tpot_s, tokens

    async def progress(self) -> None:
        if not self.made:
            await asyncio.sleep(self.first_token_s)
            self.made = 1 if self.tpot_s else self.tokens  # no time per token: all at once
        else:
            await asyncio.sleep(self.tpot_s)
            self.made += 1
        self.done = self.made >= self.tokens

    async def finished(self) -> None:
        await self.first_token()
        await asyncio.sleep(self.tpot_s * (self.tokens - self.made))  # one timer, not one a token
        self.made, self.done = max(self.made, self.tokens), True
