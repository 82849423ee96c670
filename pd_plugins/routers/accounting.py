"""What the router records about the legs it runs: worker load, learned latencies, routed prefixes.

The proxy calls these around every real leg; the cluster simulator (pd_plugins/perf/cluster_sim.py)
calls the same functions around simulated legs, so the policies see the same state in both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pd_plugins.routers.policy.base import PolicyContext, RequestInfo, uncached_tokens
from pd_plugins.routers.workers import Worker


@dataclass(slots=True)
class PrefillCharge:
    uncached: int                   # tokens charged to the worker for this leg
    ahead_tokens: int               # prefill tokens already queued there when it was sent


def prefill_started(ctx: PolicyContext, worker: Worker, info: RequestInfo) -> PrefillCharge:
    """Count a prefill leg in flight, charged with its uncached tokens."""
    charge = PrefillCharge(uncached_tokens(ctx, worker, info), worker.in_flight_prefill_tokens)
    worker.in_flight += 1
    worker.own_in_flight += 1
    worker.in_flight_prefill_tokens += charge.uncached
    worker.in_flight_tokens += info.prompt_tokens
    return charge


def prefill_ended(worker: Worker, info: RequestInfo, charge: PrefillCharge) -> None:
    worker.in_flight -= 1
    worker.own_in_flight -= 1
    worker.in_flight_prefill_tokens -= charge.uncached
    worker.in_flight_tokens -= info.prompt_tokens


def prefill_succeeded(ctx: PolicyContext, worker: Worker, info: RequestInfo, charge: PrefillCharge,
                      elapsed_s: float, engine_cached_tokens: int | None,
                      record_prefixes: bool) -> None:
    """Learn from a finished prefill leg: its latency, and (approximately) what it now caches.

    The leg's time covers the prefills queued ahead of it too, so the fit is over all the tokens
    the worker had to get through (fitting it on the leg's own tokens alone would read every
    queue as a slower machine, and the estimates would inflate under load)."""
    uncached = charge.uncached
    if info.exact_tokens and engine_cached_tokens is not None:
        uncached = max(1, info.prompt_tokens - engine_cached_tokens)  # the engine's own count
    ctx.latency.prefill.observe(charge.ahead_tokens + uncached, elapsed_s)
    if record_prefixes and not worker.removed:  # a removed worker's index entries stay gone
        ctx.prefix_index.record_routed(worker.url, info.block_keys)
    worker.record_success()


@dataclass(slots=True)
class DecodeCharge:
    # the expert histogram added to the worker's footprint, if any: what decode_ended removes.
    # Not info.expert_histogram at the end: in push mode the prefill reports it only after the
    # decode leg started, so the request's histogram changes while its decode runs.
    experts: Any = None


def decode_started(worker: Worker, info: RequestInfo) -> DecodeCharge:
    worker.in_flight += 1
    worker.own_in_flight += 1
    worker.in_flight_tokens += info.prompt_tokens
    charge = DecodeCharge(info.expert_histogram)
    if charge.experts is not None:
        worker.experts.add(charge.experts)
    return charge


def local_prefill_started(ctx: PolicyContext, decode: Worker, info: RequestInfo) -> int:
    """The decode worker prefills this request itself: charge its uncached tokens there."""
    uncached = uncached_tokens(ctx, decode, info)
    decode.in_flight_prefill_tokens += uncached
    return uncached


def local_prefill_ended(decode: Worker, uncached: int) -> None:
    """Called at the first token (or when the attempt ends without one)."""
    decode.in_flight_prefill_tokens -= uncached


def decode_ended(worker: Worker, info: RequestInfo, charge: DecodeCharge) -> None:
    worker.in_flight -= 1
    worker.own_in_flight -= 1
    worker.in_flight_tokens -= info.prompt_tokens
    if charge.experts is not None:
        worker.experts.remove(charge.experts)


def decode_observed(ctx: PolicyContext, worker: Worker, tpot_s: float) -> None:
    """Learn the decode step time at the worker's current load from a measured TPOT."""
    ctx.latency.decode_step.observe(worker.in_flight, tpot_s)


def request_succeeded(ctx: PolicyContext, decode: Worker, info: RequestInfo,
                      record_prefixes: bool) -> None:
    """The decode worker now caches the prompt too (approximate prefix index)."""
    if record_prefixes and not decode.removed:
        ctx.prefix_index.record_routed(decode.url, info.block_keys)


class DecodeCharges:
    """What one decode leg holds in the books while it runs: its decode charge and, if its decode
    worker prefills it, the prompt's uncached tokens there until the first token. `pulled`: the
    prompt tokens a pull decode reads from its prefill (the proxy learns the transfer's time
    over them), None when it pulls none or the first token is not timed."""

    __slots__ = ("decode", "info", "charge", "local_uncached", "pulled", "started")

    def __init__(self, ctx: PolicyContext, decision: Any, info: RequestInfo,
                 pulled: int | None) -> None:
        self.decode, self.info, self.pulled = decision.decode, info, pulled
        self.charge: DecodeCharge | None = decode_started(self.decode, info)
        # A local prefill queues on the decode worker until its first token: policies see it there.
        self.local_uncached = (local_prefill_started(ctx, self.decode, info)
                               if decision.prefill is None else 0)
        self.started = time.monotonic()  # the decode leg goes out now

    def first_token(self) -> None:
        """The first token (or whole answer) is in, or the leg ended without one."""
        if self.local_uncached:
            local_prefill_ended(self.decode, self.local_uncached)
            self.local_uncached = 0

    def ended(self) -> None:
        """The leg is over, however it ended (once; later calls do nothing)."""
        self.first_token()
        if self.charge is not None:
            decode_ended(self.decode, self.info, self.charge)
            self.charge = None
