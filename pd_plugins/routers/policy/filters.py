"""Filters: drop candidates that must not get this request."""

from __future__ import annotations

from pd_plugins.routers.policy.base import Params, RequestInfo, parse_params, register


class SaturationParams(Params):
    max_waiting: float = 64.0       # engine queue length above which a worker is skipped
    max_kv_usage: float = 0.98


class SaturationFilter:
    """Skips workers whose engine queue or KV cache is full, unless all of them are."""

    def __init__(self, params: SaturationParams) -> None:
        self.params = params

    def filter(self, request: RequestInfo, workers: list) -> list:
        p = self.params
        kept = [w for w in workers if w.engine_waiting <= p.max_waiting and w.kv_usage <= p.max_kv_usage]
        return kept or workers


@register("filter", "not_saturated")
def _saturation(params, ctx):
    return SaturationFilter(parse_params(params, SaturationParams, "filter not_saturated"))
