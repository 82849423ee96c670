"""Dynamo-style KV cost: prompt work left to prefill (after prefix overlap) plus blocks in flight.

NVIDIA Dynamo's published cost (docs "Routing Concepts", v1.2 to v1.6; ai-dynamo/dynamo
lib/kv-router/src/scheduling/selector/default.rs `worker_logit`):

    raw_prefill_blocks = (active_prefill_tokens + prompt_tokens) / block_size
    cost = prefill_load_scale * max(0, raw_prefill_blocks - overlap_blocks) + active_blocks

active_prefill_tokens are the uncached prompt tokens the router has queued for prefill on the
worker; active_blocks the prompt blocks of the requests it has in flight there. argmin
(temperature 0). For the decode pool Dynamo ignores the overlap (`use_overlap: false`); it also
stops tracking prefill tokens there, which only adds a term common to all decode workers in a
disaggregated flow.
"""

from __future__ import annotations

from pd_plugins.routers.policy.base import (
    Factor, Params, PolicyContext, RequestInfo, normalise_lower_is_better, parse_params, register,
)


class KvCostParams(Params):
    prefill_load_scale: Factor = 1.0
    use_overlap: bool = True


class KvCostScorer:
    uses_prefix_index = True

    def __init__(self, params: KvCostParams, ctx: PolicyContext) -> None:
        self.params, self.ctx = params, ctx

    def costs(self, request: RequestInfo, workers: list) -> list[float]:
        block = self.ctx.block_size
        out = []
        for w in workers:
            overlap = (self.ctx.prefix_index.matched_blocks(w.url, request.block_keys)
                       if self.params.use_overlap else 0)
            raw_prefill_blocks = (w.in_flight_prefill_tokens + request.prompt_tokens) / block
            active_blocks = w.in_flight_tokens / block
            out.append(self.params.prefill_load_scale * max(0.0, raw_prefill_blocks - overlap)
                       + active_blocks)
        return out

    def score(self, request: RequestInfo, workers: list) -> list[float]:
        return normalise_lower_is_better(self.costs(request, workers))


@register("scorer", "kv_cost")
def _kv_cost(params, ctx):
    return KvCostScorer(parse_params(params, KvCostParams, "scorer kv_cost"), ctx)
