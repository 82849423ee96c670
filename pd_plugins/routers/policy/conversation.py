"""Multi-turn pieces: pin a conversation to its decode worker (ConServe), and run a later turn's
new tokens there without a prefill leg when that pays (PPD's append-prefill).

- filter `session_pin`: if the conversation is pinned to a usable decode worker that still holds
  its history (at least `min_resident_share` of its last turn's prompt blocks, by the prefix
  index), only that worker remains; otherwise every candidate does, and the worker that serves
  this turn becomes the new pin (the table records it after the turn).
- decider `append_prefill`: for turn 2+ on the pinned worker, prefill locally when the uncached part
  is under `max_append_tokens` (512, PPD's default); otherwise weigh the TTFT gain against the TPOT
  cost to the decodes running there,
      score = w_ttft * (ttft_remote - ttft_local) - w_tpot * prefill_local * running_decodes
  in seconds: the turn's TTFT saved, against the time every decode running there waits while the
  append prefills (a long append on a busy worker stalls many decodes for long); local if the score
  is positive. w_tpot = 0.1 counts a decode's wait a tenth of a TTFT second: in the simulator that
  kept TPOT p95 within 5% of plain PD at 1-6 sessions/s with turn-2+ TTFT p50 over 60% lower
  (docs/benchmarks.md, "Multi-turn serving"), where counting the stall once per worker let long
  appends onto busy workers and missed the TPOT target.
"""

from __future__ import annotations

from pd_plugins.routers.policy.base import (
    Factor, Params, PolicyContext, RequestInfo, Share, Tokens, parse_params, register,
)
from pd_plugins.routers.policy.ttft import TtftEstimator


def pinned_later_turn(request: RequestInfo, decode) -> bool:
    """A conversation's turn 2+ headed for the decode worker it is pinned to: where
    `append_prefill` decides (the `default` preset's other deciders leave it alone)."""
    return request.turn > 0 and request.pinned_decode == decode.url


class SessionPinParams(Params):
    min_resident_share: Share = 0.5


class SessionPinFilter:
    uses_prefix_index = True
    uses_sessions = True

    def __init__(self, params: SessionPinParams, ctx: PolicyContext) -> None:
        self.params, self.ctx = params, ctx

    def filter(self, request: RequestInfo, workers: list) -> list:
        if request.pinned_decode is None:
            return workers
        pinned = next((w for w in workers if w.url == request.pinned_decode), None)
        if pinned is None:  # gone, unhealthy or draining: full PD elsewhere, then re-pin
            return workers
        expected = request.resident_tokens // self.ctx.block_size
        held = self.ctx.prefix_index.matched_blocks(pinned.url, request.block_keys)
        if expected and held < self.params.min_resident_share * expected:
            return workers  # it evicted the history: no reason to stay
        return [pinned]


class AppendPrefillParams(Params):
    max_append_tokens: Tokens = 512
    w_ttft: Factor = 1.0
    w_tpot: Factor = 0.1


class AppendPrefillDecider:
    uses_prefix_index = True
    uses_sessions = True

    def __init__(self, params: AppendPrefillParams, ctx: PolicyContext) -> None:
        self.params, self.ctx = params, ctx
        self.estimator = TtftEstimator(ctx)

    def disaggregate(self, request: RequestInfo, decode, prefills: list) -> tuple[bool, str]:
        if not pinned_later_turn(request, decode):
            return True, "not a later turn on its pinned worker"
        uncached = self.estimator.uncached_tokens(request, decode)
        p = self.params
        if uncached < p.max_append_tokens:
            return False, f"append-prefill: {uncached} new tokens < {p.max_append_tokens}"
        if not prefills:
            return False, "append-prefill: no prefill worker"
        latency = self.ctx.latency
        own_s = latency.prefill_s(uncached)
        local = own_s * (1 + decode.in_flight_prefill_tokens / max(1, uncached))
        remote = min(self.estimator.estimate_s(request, w) for w in prefills)
        gain_s = remote - local
        stall_s = own_s * decode.in_flight  # each running decode waits for the append once
        weighed = f"TTFT gain {gain_s * 1e3:.0f} ms against {p.w_tpot:g} x stall {stall_s * 1e3:.0f} ms"
        if p.w_ttft * gain_s - p.w_tpot * stall_s > 0:
            return False, f"append-prefill: {weighed}"
        return True, f"full PD: {weighed}"


@register("filter", "session_pin")
def _session_pin(params, ctx):
    return SessionPinFilter(parse_params(params, SessionPinParams, "filter session_pin"), ctx)


@register("decider", "append_prefill")
def _append_prefill(params, ctx):
    return AppendPrefillDecider(parse_params(params, AppendPrefillParams, "decider append_prefill"), ctx)
