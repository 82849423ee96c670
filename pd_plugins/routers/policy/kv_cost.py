"""Dynamo-style KV cost: blocks still to prefill (after prefix overlap) plus blocks being decoded.

cost = prefill_load_scale * max(0, prompt_blocks - overlap_blocks) + active_blocks, where
active_blocks are the prompt blocks of the requests the router has in flight on the worker. For the
decode pool Dynamo ignores the overlap (`use_overlap: false`).
"""

from __future__ import annotations

import math

from pd_plugins.routers.policy.base import (
    Params, PolicyContext, RequestInfo, normalise_lower_is_better, parse_params, register,
)


class KvCostParams(Params):
    prefill_load_scale: float = 1.0
    use_overlap: bool = True


class KvCostScorer:
    uses_prefix_index = True

    def __init__(self, params: KvCostParams, ctx: PolicyContext) -> None:
        self.params, self.ctx = params, ctx

    def costs(self, request: RequestInfo, workers: list) -> list[float]:
        block = self.ctx.block_size
        prompt_blocks = math.ceil(request.prompt_tokens / block)
        out = []
        for w in workers:
            overlap = (self.ctx.prefix_index.matched_blocks(w.url, request.block_keys)
                       if self.params.use_overlap else 0)
            active_blocks = w.in_flight_tokens / block
            out.append(self.params.prefill_load_scale * max(0, prompt_blocks - overlap) + active_blocks)
        return out

    def score(self, request: RequestInfo, workers: list) -> list[float]:
        return normalise_lower_is_better(self.costs(request, workers))


@register("scorer", "kv_cost")
def _kv_cost(params, ctx):
    return KvCostScorer(parse_params(params, KvCostParams, "scorer kv_cost"), ctx)
