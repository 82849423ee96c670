"""What every flow shares: the attempt being run and the prefill-leg callback."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Protocol

from pd_plugins.routers.policy.base import Decision
from pd_plugins.routers.request import ClientRequest, LegBody


@dataclass
class Attempt:
    """One try at serving a request on one (prefill, decode) pair."""

    request: ClientRequest
    decision: Decision
    request_id: str               # unique per attempt; both legs carry it as X-Request-Id
    path: str                     # /v1/completions or /v1/chat/completions
    excluded_decode: frozenset = frozenset()  # decode workers that failed earlier attempts
    # the client left just as the prefill answered (proxy.py: the KV it holds is released)
    client_left: bool = False


# Runs the prefill leg on attempt.decision.prefill with the router's accounting and timeout;
# returns its answer's kv_transfer_params (None if absent) or raises WorkerFailed / RequestRefused.
PrefillLeg = Callable[[Attempt, LegBody], Coroutine[Any, Any, Any]]


class PdFlow(Protocol):
    # True: the prefill leg answers before the decode leg goes out, and the flow also has
    # prefill_body(client body) and decode_body(attempt, the prefill's kv_transfer_params), which
    # raises WorkerFailed (the proxy's callbacks run the legs themselves: exchange.py)
    sequential: bool
    # True: both legs go out together, and the flow also has bodies(attempt) -> (the prefill's
    # body, the decode's), decode_first (whether the decode leg goes first) and head_start_s
    # (how long the prefill leg then waits) (exchange.py runs them too)
    alongside: bool

    async def prepare(self, attempt: Attempt, prefill_leg: PrefillLeg
                      ) -> tuple[LegBody, asyncio.Task | None]: ...


def one_token_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: the client's request cut to one token, not streamed."""
    leg = {**body, "max_tokens": 1, "stream": False}
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    if "stream_options" in leg or "min_tokens" in leg:  # (few requests have either)
        leg.pop("stream_options", None)
        leg.pop("min_tokens", None)
    return leg
