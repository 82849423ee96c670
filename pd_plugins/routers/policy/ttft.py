"""Mooncake-style TTFT estimate, as a scorer and as an early-rejection admission step.

For a prefill worker: TTFT = queue (its queued prefills) + prefill(uncached tokens after its prefix
cache) + transfer (the prompt's KV over the link). The scorer prefers the lowest estimate; the
admission step answers 429 with Retry-After when even the best estimate misses the TTFT SLO, or when
the least-loaded decode worker's next step would miss the TPOT SLO (Mooncake Conductor, Alg. 1).
Admission judges the route the scheduler chose: a request its deciders leave on the decode worker
(local prefill, append-prefill, an adapter no prefill worker serves) is judged on that worker's
own prefill estimate, not on the prefill pool's queues it never joins.
"""

from __future__ import annotations

import math
from typing import Annotated

from msgspec import Meta

from pd_plugins.routers.policy.base import (
    Decision, Millis, Params, PolicyContext, Rejection, RequestInfo, parse_params, register,
    register_plain,
    uncached_tokens,
)


class TtftEstimator:
    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx

    def uncached_tokens(self, request: RequestInfo, worker) -> int:
        return uncached_tokens(self.ctx, worker, request)

    def estimate_s(self, request: RequestInfo, worker) -> float:
        model = self.ctx.latency
        return (model.queue_s(worker.in_flight_prefill_tokens, worker.in_flight)
                + model.prefill_s(self.uncached_tokens(request, worker))
                + model.transfer_s(request.prompt_tokens))

    def local_estimate_s(self, request: RequestInfo, decode) -> float:
        """TTFT when `decode` prefills the prompt itself: the local prefills it already runs
        (their tokens) + its own uncached tokens; no KV moves."""
        model = self.ctx.latency
        _, per_token = model.prefill.coefficients
        return (per_token * decode.in_flight_prefill_tokens
                + model.prefill_s(self.uncached_tokens(request, decode)))


class TtftScorer:
    uses_prefix_index = True

    def __init__(self, ctx: PolicyContext) -> None:
        self.estimator = TtftEstimator(ctx)

    def score(self, request: RequestInfo, workers: list) -> list[float]:
        estimates = [self.estimator.estimate_s(request, w) for w in workers]
        best = min(estimates)
        return [best / e if e > 0 else 1.0 for e in estimates]


class SloParams(Params):
    ttft_slo_ms: Millis = 2000.0
    tpot_slo_ms: Millis | None = None
    # Also reject while every decode worker's KV cache is this full (scraped), or more than half
    # that and its engine queues: a new request would wait there for KV space, a delay the TTFT
    # estimate cannot see. (A queue alone is no sign: vLLM counts a request that is pulling its
    # KV as waiting.)
    # (0 would reject every request)
    decode_kv_limit: Annotated[float, Meta(gt=0, le=1)] | None = None


class SloAdmission:
    uses_prefix_index = True

    def __init__(self, params: SloParams, ctx: PolicyContext) -> None:
        self.params, self.ctx = params, ctx
        self.estimator = TtftEstimator(ctx)

    def admit(self, request: RequestInfo, decision: Decision | None = None) -> Rejection | None:
        """`decision`: the route the scheduler chose for the request (None: not known, judged as
        if disaggregated)."""
        pool = self.ctx.pool
        if decision is not None and decision.prefill is None:
            best = self.estimator.local_estimate_s(request, decision.decode)
            route = " (prefilled on its decode worker)"
        else:
            prefills = pool.usable("prefill") or pool.usable("decode")
            if not prefills:
                return None  # nothing to estimate on: the proxy answers 503 itself
            best = min(self.estimator.estimate_s(request, w) for w in prefills)
            route = ""
        slo = self.params.ttft_slo_ms / 1e3
        if best > slo:
            return Rejection(429, f"predicted TTFT {best * 1e3:.0f} ms{route} exceeds the "
                                  f"{self.params.ttft_slo_ms:.0f} ms SLO; retry later",
                             retry_after_s=_retry_after(best - slo))
        limit = self.params.decode_kv_limit
        if limit is not None:
            decodes = pool.usable("decode")
            if decodes and all(_kv_full(w, limit) for w in decodes):
                return Rejection(429, f"every decode worker's KV cache is {limit:.0%} full or "
                                      "queueing for space; retry later", retry_after_s=1.0)
        if self.params.tpot_slo_ms is not None:
            decodes = pool.usable("decode")
            if decodes:
                step = min(self.ctx.latency.decode_step_s(w.load + 1) for w in decodes)
                if step * 1e3 > self.params.tpot_slo_ms:
                    return Rejection(429, f"predicted TPOT {step * 1e3:.0f} ms exceeds the "
                                          f"{self.params.tpot_slo_ms:.0f} ms SLO; retry later",
                                     retry_after_s=1.0)
        return None


def _kv_full(worker, limit: float) -> bool:
    return worker.kv_usage >= limit or (worker.engine_waiting > 0 and worker.kv_usage >= limit / 2)


def _retry_after(excess_s: float) -> float:
    return float(min(60, max(1, math.ceil(excess_s))))


register_plain("scorer", "ttft", TtftScorer)


@register("admission", "slo")
def _slo(params, ctx):
    return SloAdmission(parse_params(params, SloParams, "admission slo"), ctx)
