"""ELDR's decode routing pieces: prefer decode workers already running requests that use the same
MoE experts (expert_signature.py explains the signature and the footprint).

- filter `expert_band` (ELDR's locality band): keep the workers whose footprint is within `tau` of
  the best match for the request's signature (then another scorer, e.g. least_loaded, picks among
  them). tau = 0 is strict affinity, which the paper finds hurts tail TPOT; default 0.1.
- scorer `expert_locality`: the similarity itself, in [0, 1], to weigh against other scorers.

A worker running nothing matches 0. Both pass every worker through unchanged while the request has
no signature yet (a router schedules before the prefill answers; the decode is chosen again once
the signature is known, see Scheduler.rebind_decode).
"""

from __future__ import annotations

from pd_plugins.routers.policy.base import (
    Params, RequestInfo, Share, parse_params, register, register_plain,
)
from pd_plugins.routers.policy.expert_signature import locality_band, similarity


def _similarities(request: RequestInfo, workers: list) -> list[float]:
    return [0.0 if w.experts.total is None else similarity(request.expert_histogram,
                                                           w.experts.total)
            for w in workers]


class ExpertBandParams(Params):
    tau: Share = 0.1                # 0: strict affinity


class ExpertBandFilter:
    uses_expert_signatures = True

    def __init__(self, params: ExpertBandParams) -> None:
        self.tau = params.tau

    def filter(self, request: RequestInfo, workers: list) -> list:
        if request.expert_histogram is None or not workers:
            return workers
        return [workers[i] for i in locality_band(_similarities(request, workers), self.tau)]


class ExpertLocalityScorer:
    uses_expert_signatures = True

    def score(self, request: RequestInfo, workers: list) -> list[float]:
        if request.expert_histogram is None:
            return [0.0] * len(workers)
        return _similarities(request, workers)


@register("filter", "expert_band")
def _expert_band(params, ctx):
    return ExpertBandFilter(parse_params(params, ExpertBandParams, "filter expert_band"))


register_plain("scorer", "expert_locality", lambda ctx: ExpertLocalityScorer())
