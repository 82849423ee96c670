"""Compose the pieces into a scheduler: admission, decode profile, deciders, prefill profile."""

from __future__ import annotations

from typing import Any

import msgspec

from pd_plugins.routers.config import ConfigError, PolicySpec, ProfileSpec
from pd_plugins.routers.policy.base import (
    Choice, Decision, PolicyContext, Rejection, RequestInfo, build,
)

# `--policy NAME` shorthands; a YAML `policy:` section spells out the same structure.
PRESETS: dict[str, dict[str, Any]] = {
    "round_robin": {
        "prefill": {"picker": {"name": "round_robin"}},
        "decode": {"picker": {"name": "round_robin"}},
    },
    "least_loaded": {
        "prefill": {"scorers": [{"name": "least_loaded"}]},
        "decode": {"scorers": [{"name": "least_loaded"}]},
    },
    # llm-d's defaults: prefix weight 2, load weight 1, disaggregate from 16 uncached tokens.
    "prefix_cache": {
        "prefill": {"scorers": [{"name": "prefix_cache", "weight": 2}, {"name": "least_loaded"}]},
        "decode": {"scorers": [{"name": "least_loaded"}]},
        "deciders": [{"name": "uncached_length", "params": {"min_uncached_tokens": 16}}],
    },
    # NVIDIA Dynamo's KV router cost; decode routing ignores the overlap.
    "kv_cost": {
        "prefill": {"scorers": [{"name": "kv_cost"}]},
        "decode": {"scorers": [{"name": "kv_cost", "params": {"use_overlap": False}}]},
    },
    # Mooncake Conductor: minimum estimated TTFT, early rejection, convertible decoders.
    "ttft_slo": {
        "prefill": {"filters": [{"name": "not_saturated"}], "scorers": [{"name": "ttft"}]},
        "decode": {"filters": [{"name": "not_saturated"}], "scorers": [{"name": "least_loaded"}]},
        "deciders": [{"name": "uncached_length"}, {"name": "prefill_load"}],
        "admission": {"name": "slo", "params": {"ttft_slo_ms": 2000}},
    },
}
DEFAULT_POLICY = "prefix_cache"


def preset(name: str) -> PolicySpec:
    if name not in PRESETS:
        raise ConfigError(f"unknown policy {name!r}; known: {', '.join(sorted(PRESETS))}")
    return msgspec.convert(PRESETS[name], PolicySpec)


class Profile:
    """Filters, then weighted scorers, then a picker, over one pool."""

    def __init__(self, spec: ProfileSpec, ctx: PolicyContext, pool_name: str) -> None:
        self.filters = [build("filter", f.name, f.params, ctx) for f in spec.filters]
        self.scorers = [(s.name, s.weight, build("scorer", s.name, s.params, ctx)) for s in spec.scorers]
        for name, weight, _ in self.scorers:
            if weight < 0:
                raise ConfigError(f"{pool_name} scorer {name}: weight must be >= 0 (got {weight})")
        self.picker = build("picker", spec.picker.name, spec.picker.params, ctx)

    def choose(self, request: RequestInfo, candidates: list) -> Choice | None:
        for f in self.filters:
            candidates = f.filter(request, candidates)
        if not candidates:
            return None
        totals = [0.0] * len(candidates)
        parts: list[list[str]] = [[] for _ in candidates]
        for name, weight, scorer in self.scorers:
            for i, value in enumerate(scorer.score(request, candidates)):
                totals[i] += weight * value
                parts[i].append(f"{name}={value:.2f}")
        worker = self.picker.pick(candidates, totals)
        i = candidates.index(worker)
        reason = " ".join(parts[i]) if parts[i] else type(self.picker).__name__
        return Choice(worker, reason)


class Scheduler:
    def __init__(self, spec: PolicySpec, ctx: PolicyContext, fixed_decode_url: str | None = None):
        self.ctx = ctx
        self.prefill = Profile(spec.prefill, ctx, "prefill")
        self.decode = Profile(spec.decode, ctx, "decode")
        self.deciders = [(d.name, build("decider", d.name, d.params, ctx)) for d in spec.deciders]
        self.admission = (build("admission", spec.admission.name, spec.admission.params, ctx)
                          if spec.admission else None)
        self.fixed_decode_url = fixed_decode_url  # sidecar mode
        pieces = [*self.prefill.filters, *self.decode.filters, *(s for _, _, s in self.prefill.scorers),
                  *(s for _, _, s in self.decode.scorers), *(d for _, d in self.deciders), self.admission]
        # Block keys cost CPU per request: only compute and record them when a piece reads them.
        self.uses_prefix_index = any(getattr(p, "uses_prefix_index", False) for p in pieces)

    def admit(self, request: RequestInfo) -> Rejection | None:
        return self.admission.admit(request) if self.admission else None

    def choose_decode(self, request: RequestInfo, exclude: set) -> Choice | None:
        candidates = [w for w in self.ctx.pool.usable("decode") if w not in exclude]
        if self.fixed_decode_url is not None:
            candidates = [w for w in candidates if w.url == self.fixed_decode_url]
            return Choice(candidates[0], "sidecar") if candidates else None
        return self.decode.choose(request, candidates)

    def choose_prefill(self, request: RequestInfo, decode_choice: Choice,
                       exclude: set) -> tuple[Choice | None, str]:
        """The prefill worker, or None with the reason the decode worker prefills locally."""
        candidates = [w for w in self.ctx.pool.usable("prefill") if w not in exclude]
        for name, decider in self.deciders:
            go, why = decider.disaggregate(request, decode_choice.worker, candidates)
            if not go:
                return None, f"{name}: {why}"
        if not candidates:
            return None, "no usable prefill worker"
        return self.prefill.choose(request, candidates), ""

    def schedule(self, request: RequestInfo, exclude_prefill: set = frozenset(),
                 exclude_decode: set = frozenset()) -> Decision | None:
        decode = self.choose_decode(request, set(exclude_decode))
        if decode is None:
            return None
        prefill, why_local = self.choose_prefill(request, decode, set(exclude_prefill))
        reasons = [f"decode: {decode.reason}"]
        if prefill is None:
            reasons.append(f"local prefill: {why_local}")
            return Decision(decode.worker, None, reasons)
        reasons.append(f"prefill: {prefill.reason}")
        return Decision(decode.worker, prefill.worker, reasons)


