"""Prefix-cache scorer: the share of the prompt's blocks a worker already holds."""

from __future__ import annotations

from pd_plugins.routers.policy.base import PolicyContext, RequestInfo, register_plain


class PrefixCacheScorer:
    uses_prefix_index = True

    def __init__(self, ctx: PolicyContext) -> None:
        self.index = ctx.prefix_index

    def score(self, request: RequestInfo, workers: list) -> list[float]:
        total = len(request.block_keys)
        if total == 0:
            return [0.0] * len(workers)
        return [self.index.matched_blocks(w.url, request.block_keys) / total for w in workers]


register_plain("scorer", "prefix_cache", PrefixCacheScorer)
