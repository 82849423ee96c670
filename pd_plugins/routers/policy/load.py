"""Load scorers: fewer requests in flight, or more free KV cache, scores higher."""

from __future__ import annotations

from pd_plugins.routers.policy.base import RequestInfo, normalise_lower_is_better, register_plain


class LeastLoadedScorer:
    """The router's in-flight count, or the engine's own queue when that is larger."""

    def score(self, request: RequestInfo, workers: list) -> list[float]:
        return normalise_lower_is_better([w.load for w in workers])


class KvUsageScorer:
    """Free KV cache as scraped from the engine (1 - usage)."""

    def score(self, request: RequestInfo, workers: list) -> list[float]:
        return [max(0.0, 1.0 - w.kv_usage) for w in workers]


register_plain("scorer", "least_loaded", lambda ctx: LeastLoadedScorer())


register_plain("scorer", "kv_usage", lambda ctx: KvUsageScorer())
