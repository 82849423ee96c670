"""PD deciders: should this request be disaggregated, or prefilled on its decode worker?

- uncached_length (llm-d): disaggregate only if the decode worker lacks at least
  `min_uncached_tokens` of the prompt; a short or mostly cached prompt is cheaper to prefill there.
- prefill_load (TokenScale's convertible decoders): when the prefill pool is saturated, the decode
  worker prefills locally if its own estimate beats the best prefill worker's by `margin`.

Both take `skip_pinned_turns`: a conversation's later turn on its pinned decode worker is then left
to `append_prefill` (conversation.py), which weighs the stall of the decodes running there; these
rules, tuned on single-turn traffic, would otherwise overrule its choice to go through PD.
"""

from __future__ import annotations

from pd_plugins.routers.policy.base import (
    Count, Factor, Params, PolicyContext, RequestInfo, Share, Tokens, parse_params, register,
)
from pd_plugins.routers.policy.conversation import pinned_later_turn
from pd_plugins.routers.policy.ttft import TtftEstimator

LEFT_TO_APPEND = "a later turn on its pinned worker: append_prefill's call"


class UncachedLengthParams(Params):
    min_uncached_tokens: Tokens = 16
    skip_pinned_turns: bool = False


class UncachedLengthDecider:
    uses_prefix_index = True

    def __init__(self, params: UncachedLengthParams, ctx: PolicyContext) -> None:
        self.params, self.ctx = params, ctx

    def disaggregate(self, request: RequestInfo, decode, prefills: list) -> tuple[bool, str]:
        if self.params.skip_pinned_turns and pinned_later_turn(request, decode):
            return True, LEFT_TO_APPEND
        cached = self.ctx.prefix_index.matched_blocks(decode.url, request.block_keys) * self.ctx.block_size
        uncached = max(0, request.prompt_tokens - cached)
        if uncached < self.params.min_uncached_tokens:
            return False, f"uncached {uncached} < {self.params.min_uncached_tokens} tokens"
        return True, f"uncached {uncached} tokens"


class PrefillLoadParams(Params):
    margin: Factor = 1.5            # local prefill must be this many times faster
    min_prefill_queue: Count = 2    # only when every prefill worker has this many queued
    max_decode_kv_usage: Share = 1.0  # and the decode worker's KV cache (scraped) is below this
    skip_pinned_turns: bool = False


class PrefillLoadDecider:
    uses_prefix_index = True

    def __init__(self, params: PrefillLoadParams, ctx: PolicyContext) -> None:
        self.params = params
        self.estimator = TtftEstimator(ctx)
        self.ctx = ctx

    def disaggregate(self, request: RequestInfo, decode, prefills: list) -> tuple[bool, str]:
        if self.params.skip_pinned_turns and pinned_later_turn(request, decode):
            return True, LEFT_TO_APPEND
        if not prefills or min(w.in_flight for w in prefills) < self.params.min_prefill_queue:
            return True, "prefill pool not saturated"
        if decode.kv_usage >= self.params.max_decode_kv_usage:
            return True, f"decode KV {decode.kv_usage:.0%} full"
        remote = min(self.estimator.estimate_s(request, w) for w in prefills)
        # A local prefill also stalls the decode's running batch for its duration.
        local = (self.ctx.latency.prefill_s(self.estimator.uncached_tokens(request, decode))
                 * (1 + decode.in_flight_prefill_tokens / max(1, request.prompt_tokens)))
        if local * self.params.margin < remote:
            return False, f"prefill pool saturated: local {local * 1e3:.0f} ms vs remote {remote * 1e3:.0f} ms"
        return True, f"remote prefill {remote * 1e3:.0f} ms"


@register("decider", "uncached_length")
def _uncached(params, ctx):
    return UncachedLengthDecider(parse_params(params, UncachedLengthParams, "decider uncached_length"), ctx)


@register("decider", "prefill_load")
def _prefill_load(params, ctx):
    return PrefillLoadDecider(parse_params(params, PrefillLoadParams, "decider prefill_load"), ctx)
