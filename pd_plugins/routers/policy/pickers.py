"""Pickers: choose one worker from scored candidates."""

from __future__ import annotations

import random

from pd_plugins.routers.policy.base import Params, parse_params, register, register_plain


class MaxScorePicker:
    """The best weighted score; ties go round robin so equal workers share the load."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, workers: list, scores: list[float]):
        best = max(scores)
        tied = [w for w, s in zip(workers, scores) if s >= best - 1e-9]
        self._turn += 1
        if not tied:  # no score compares (NaN): any of them, in turn, rather than no answer
            tied = workers
        return tied[self._turn % len(tied)]


class RoundRobinPicker:
    """Ignores scores: each candidate in turn (by the order workers were added)."""

    def __init__(self) -> None:
        self._turn = -1

    def pick(self, workers: list, scores: list[float]):
        self._turn += 1
        if len(workers) == 1:
            return workers[0]
        ordered = sorted(workers, key=_ordinal)
        return ordered[self._turn % len(ordered)]


def _ordinal(worker) -> int:
    return worker.ordinal


class RandomParams(Params):
    seed: int | None = None


class WeightedRandomPicker:
    """Random, in proportion to score (a softmax-free version of Dynamo's temperature mode)."""

    def __init__(self, params: RandomParams) -> None:
        self.rng = random.Random(params.seed)

    def pick(self, workers: list, scores: list[float]):
        if sum(scores) <= 0:
            return self.rng.choice(workers)
        return self.rng.choices(workers, weights=scores, k=1)[0]


register_plain("picker", "max_score", lambda ctx: MaxScorePicker())


register_plain("picker", "round_robin", lambda ctx: RoundRobinPicker())


register("picker", "random")(
    lambda params, ctx: WeightedRandomPicker(parse_params(params, RandomParams, "picker random")))
