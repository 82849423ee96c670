"""Mooncake-style TTFT estimate, as a scorer and as an early-rejection admission step.

For a prefill worker: TTFT = queue (its queued prefills) + prefill(uncached tokens after its prefix
cache) + transfer (the prompt's KV over the link). The scorer prefers the lowest estimate; the
admission step answers 429 with Retry-After when even the best estimate misses the TTFT SLO, or when
the least-loaded decode worker's next step would miss the TPOT SLO (Mooncake Conductor, Alg. 1).
Admission judges the route the scheduler chose: a request its deciders leave on the decode worker
(local prefill, append-prefill, an adapter no prefill worker serves) is judged on that worker's
own prefill estimate, not on the prefill pool's queues it never joins. A prompt whose estimate
misses the SLO even with nothing queued ahead of it gets its 429 without Retry-After (waiting
cannot help), and only from a fitted line (`min_samples` samples): on the configured priors a
refusal is only ever for the queue ahead, which drains (a fresh router on the shipped priors
refused every prompt over ~7,400 tokens for good, as a refused request teaches the fit nothing).
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

    def queue_s(self, worker) -> float:
        """The wait for the prefills queued on `worker` (part of estimate_s)."""
        return self.ctx.latency.queue_s(worker.in_flight_prefill_tokens, worker.in_flight)

    def estimate_s(self, request: RequestInfo, worker) -> float:
        model = self.ctx.latency
        return (self.queue_s(worker)
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
        pool, latency, estimator = self.ctx.pool, self.ctx.latency, self.estimator
        local = decision is not None and decision.prefill is None
        prefills = [] if local else pool.usable("prefill") or pool.usable("decode")
        if not local and not prefills:
            return None  # nothing to estimate on: the proxy answers 503 itself
        if local:
            idle = latency.prefill_s(estimator.uncached_tokens(request, decision.decode))
            best = estimator.local_estimate_s(request, decision.decode)
            route = " (prefilled on its decode worker)"
        else:
            estimates = [(estimator.estimate_s(request, w), estimator.queue_s(w)) for w in prefills]
            best = min(e for e, _ in estimates)
            idle = min(e - queued for e, queued in estimates)  # with nothing queued ahead
            route = ""
        slo_ms = self.params.ttft_slo_ms
        if idle * 1e3 > slo_ms:
            # Retrying cannot help. On the priors (under min_samples samples) that is no verdict:
            # refused, the prompt would stay refused, and teach the fit nothing.
            if latency.prefill.fitted:
                return Rejection(429, f"predicted TTFT {best * 1e3:.0f} ms{route} exceeds the "
                                      f"{slo_ms:.0f} ms SLO: the prompt's prefill alone takes "
                                      f"{idle * 1e3:.0f} ms with nothing queued; a retry will "
                                      "not meet it")
        elif best * 1e3 > slo_ms:  # the queue ahead: it drains, then a retry is admitted
            return Rejection(429, f"predicted TTFT {best * 1e3:.0f} ms{route} exceeds the "
                                  f"{slo_ms:.0f} ms SLO; retry later",
                             retry_after_s=_retry_after(best - slo_ms / 1e3))
        limit = self.params.decode_kv_limit
        if limit is not None:
            decodes = pool.usable("decode")
            if decodes and all(_kv_full(w, limit) for w in decodes):
                return Rejection(429, f"every decode worker's KV cache is {limit:.0%} full or "
                                      "queueing for space; retry later", retry_after_s=1.0)
        if self.params.tpot_slo_ms is not None:
            decodes = pool.usable("decode")
            if decodes:
                step = min(latency.decode_step_s(w.load + 1) for w in decodes)
                alone = latency.decode_step_s(1) * 1e3 > self.params.tpot_slo_ms
                if alone and latency.decode_step.fitted:  # no load to wait out
                    return Rejection(429, f"predicted TPOT {step * 1e3:.0f} ms exceeds the "
                                          f"{self.params.tpot_slo_ms:.0f} ms SLO: a step of one "
                                          "request alone misses it")
                if not alone and step * 1e3 > self.params.tpot_slo_ms:
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
