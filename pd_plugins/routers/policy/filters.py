"""Filters: drop candidates that must not get this request."""

from __future__ import annotations

from pd_plugins.routers.policy.base import (
    Factor, Params, RequestInfo, Requests, Share, parse_params, register,
)


class SaturationParams(Params):
    max_waiting: Requests = 64.0    # engine queue length above which a worker is skipped
    max_kv_usage: Share = 0.98


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


class LoadBandParams(Params):
    slack: Factor = 0.25            # keep workers within this share above the least loaded ...
    margin: Requests = 2.0          # ... plus this many requests


class LoadBandFilter:
    """Keeps the workers whose load is within `slack` (and `margin` requests) of the least
    loaded one. Placed before an affinity filter (expert_band, for ELDR), it stops affinity from
    piling a popular kind of request onto one worker."""

    def __init__(self, params: LoadBandParams) -> None:
        self.params = params

    def filter(self, request: RequestInfo, workers: list) -> list:
        if not workers:
            return workers
        least = min(w.load for w in workers)
        limit = least * (1 + self.params.slack) + self.params.margin
        return [w for w in workers if w.load <= limit]


@register("filter", "load_band")
def _load_band(params, ctx):
    return LoadBandFilter(parse_params(params, LoadBandParams, "filter load_band"))
