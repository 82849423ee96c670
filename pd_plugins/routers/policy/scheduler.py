"""Compose the pieces into a scheduler: admission, decode profile, deciders, prefill profile."""

from __future__ import annotations

from typing import Any, Collection

import msgspec

from pd_plugins.routers.config import ConfigError, PolicySpec, ProfileSpec
from pd_plugins.routers.policy.adapters import serving_adapter
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
    # Ours for goodput (docs/benchmarks.md, "Routing quality"): Mooncake's TTFT estimate for the
    # prefill; decode by load, prefix affinity (less KV to move) and free KV; prompts with under
    # 1024 uncached tokens on the decode worker are prefilled there (PPD's append-prefill), and
    # decode workers prefill when the prefill pool is saturated, while their KV is under 70%
    # (TokenScale); early rejection at an internal 1.5 s target (headroom under a 2 s SLO for the
    # estimate's error) and while every decode worker's KV cache is 90% full.
    "goodput": {
        "prefill": {"filters": [{"name": "not_saturated"}], "scorers": [{"name": "ttft"}]},
        "decode": {"filters": [{"name": "not_saturated"}],
                   "scorers": [{"name": "least_loaded"}, {"name": "prefix_cache", "weight": 2},
                               {"name": "kv_usage"}]},
        "deciders": [{"name": "uncached_length", "params": {"min_uncached_tokens": 1024}},
                     {"name": "prefill_load", "params": {"max_decode_kv_usage": 0.7}}],
        "admission": {"name": "slo", "params": {"ttft_slo_ms": 1500, "decode_kv_limit": 0.9}},
    },
    # Ours for multi-turn traffic: `goodput`'s scoring and admission, conversations pinned to their
    # decode worker (ConServe), and, as the only decider, later turns appended there without a
    # prefill leg when that pays (PPD; convertible prefill only cost TPOT here).
    "multi_turn": {
        "prefill": {"filters": [{"name": "not_saturated"}], "scorers": [{"name": "ttft"}]},
        "decode": {"filters": [{"name": "session_pin"}, {"name": "not_saturated"}],
                   "scorers": [{"name": "least_loaded"}, {"name": "prefix_cache", "weight": 2},
                               {"name": "kv_usage"}]},
        "deciders": [{"name": "append_prefill"}],
        "admission": {"name": "slo", "params": {"ttft_slo_ms": 1500, "decode_kv_limit": 0.9}},
    },
    # The router's default: `goodput` on single-turn traffic, `multi_turn` on conversations.
    # `goodput` sends a chat's later turns wherever scoring says (turn-2+ TTFT p95 about twice
    # `multi_turn`'s on bench/multi_turn.py's conversations in the simulator);
    # `multi_turn` gives up `goodput`'s local prefill of short prompts and convertible decoders.
    # Here a request outside a conversation passes the pin and the append decider untouched and
    # is routed exactly as under `goodput`; a later turn on its pinned worker is `append_prefill`'s
    # call alone, as under `multi_turn`. One difference from `multi_turn`: saturation is filtered
    # before the pin, so a conversation leaves a worker whose queue or KV cache is full instead of
    # piling more turns (and their appends) onto it: with the pin first, this stack lost a quarter
    # of `goodput`'s goodput on the Mooncake trace (`bench/routing_sim.py --quick`), where prefix
    # detection makes most requests later turns. docs/benchmarks.md compares the three.
    "default": {
        "prefill": {"filters": [{"name": "not_saturated"}], "scorers": [{"name": "ttft"}]},
        "decode": {"filters": [{"name": "not_saturated"}, {"name": "session_pin"}],
                   "scorers": [{"name": "least_loaded"}, {"name": "prefix_cache", "weight": 2},
                               {"name": "kv_usage"}]},
        "deciders": [{"name": "append_prefill"},
                     {"name": "uncached_length",
                      "params": {"min_uncached_tokens": 1024, "skip_pinned_turns": True}},
                     {"name": "prefill_load",
                      "params": {"max_decode_kv_usage": 0.7, "skip_pinned_turns": True}}],
        "admission": {"name": "slo", "params": {"ttft_slo_ms": 1500, "decode_kv_limit": 0.9}},
    },
    # Ours for MoE models (ELDR, arXiv 2607.00466): among the decode workers not much busier
    # than the least loaded, those whose running requests use the prompt's experts (within
    # tau = 0.1 of the best match), least loaded first. Without the load band, affinity piles a
    # popular topic onto one worker (docs/benchmarks.md, "Expert-locality decode routing").
    "eldr": {
        "prefill": {"scorers": [{"name": "least_loaded"}]},
        "decode": {"filters": [{"name": "load_band", "params": {"slack": 0.25, "margin": 2}},
                               {"name": "expert_band", "params": {"tau": 0.1}}],
                   "scorers": [{"name": "least_loaded"}]},
    },
    # -- the peers' own rules (policy/peers.py cites the source of each) ----------------------
    # vllm-router 0.1.17 `--vllm-pd-disaggregation --policy kv_aware`: prefill by
    # new + active prefill tokens, decode by fewest requests; always disaggregates.
    "vllm_kv_aware": {
        "prefill": {"scorers": [{"name": "vllm_kv_aware"}]},
        "decode": {"scorers": [{"name": "vllm_kv_aware", "params": {"decode": True}}]},
    },
    # sglang-router 0.3.2 `--pd-disaggregation --policy cache_aware`: one cache_aware instance
    # (own tree) per pool; always disaggregates.
    "sglang_cache_aware": {
        "prefill": {"scorers": [{"name": "sglang_cache_aware"}]},
        "decode": {"scorers": [{"name": "sglang_cache_aware"}]},
    },
    # llm-d-inference-scheduler deploy/config/pd-epp-config.yaml: both profiles score
    # prefix-cache 2 + queue 1 (engine waiting queue), prefix-based PD decider at 16 tokens.
    "llm_d": {
        "prefill": {"scorers": [{"name": "prefix_cache", "weight": 2}, {"name": "queue_depth"}]},
        "decode": {"scorers": [{"name": "prefix_cache", "weight": 2}, {"name": "queue_depth"}]},
        "deciders": [{"name": "uncached_length", "params": {"min_uncached_tokens": 16}}],
    },
    # Mooncake Conductor (FAST'25 Alg. 1): least TTFT with the option of fetching a longer remote
    # prefix, decode by load, 429 when the TTFT or the TBT would miss its SLO.
    "mooncake": {
        "prefill": {"scorers": [{"name": "mooncake_ttft"}]},
        "decode": {"scorers": [{"name": "least_loaded"}]},
        "admission": {"name": "mooncake_slo", "params": {"ttft_slo_ms": 2000, "tpot_slo_ms": 100}},
    },
}
# vllm-router with session affinity (its sticky sessions by x-session-id): every turn to the
# conversation's decode worker, always through a prefill leg (no append-prefill).
PRESETS["vllm_session_affinity"] = {
    "prefill": PRESETS["vllm_kv_aware"]["prefill"],
    "decode": {"filters": [{"name": "session_pin", "params": {"min_resident_share": 0.0}}],
               "scorers": [{"name": "vllm_kv_aware", "params": {"decode": True}}]},
}
# NVIDIA Dynamo 1.6's KV router is the kv_cost preset (policy/kv_cost.py cites the formula).
PRESETS["dynamo"] = PRESETS["kv_cost"]
DEFAULT_POLICY = "default"

# The benchmark harness's peers, and where each one's prefix knowledge comes from: "events" = the
# engines' KV events (exact), "routed" = the router's own record of the prompts it routed
# (approximate). round_robin reads no prefix, so its entry is moot. vllm-router kv_aware and Dynamo
# (default --kv-events) subscribe to KV events; sglang-router cache_aware keeps an approximate
# radix tree of routed text; llm-d's PD sample config uses the approximate prefix-cache-scorer
# (precise-prefix-cache-scorer, on KV events, is opt-in); Mooncake's Conductor has the global
# cache view.
PEER_PRESETS = ("round_robin", "vllm_kv_aware", "sglang_cache_aware", "dynamo", "llm_d", "mooncake")
PREFIX_SOURCE: dict[str, str] = {
    "round_robin": "routed", "vllm_kv_aware": "events", "sglang_cache_aware": "routed",
    "dynamo": "events", "llm_d": "routed", "mooncake": "events", "vllm_session_affinity": "events",
}
# ours read KV events when workers publish them
OUR_PRESETS = ("prefix_cache", "ttft_slo", "goodput", "multi_turn", "default")


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
        self._picker_name = type(self.picker).__name__

    def choose(self, request: RequestInfo, candidates: list) -> Choice | None:
        for f in self.filters:
            candidates = f.filter(request, candidates)
        if not candidates:
            return None
        if not self.scorers:  # the picker alone (round robin): no scores to add up or explain
            return Choice(self.picker.pick(candidates, [0.0] * len(candidates)), self._picker_name)
        totals = [0.0] * len(candidates)
        parts: list[list[str]] = [[] for _ in candidates]
        for name, weight, scorer in self.scorers:
            for i, value in enumerate(scorer.score(request, candidates)):
                totals[i] += weight * value
                parts[i].append(f"{name}={value:.2f}")
        worker = self.picker.pick(candidates, totals)
        i = candidates.index(worker)
        reason = " ".join(parts[i]) if parts[i] else self._picker_name
        return Choice(worker, reason)


class Scheduler:
    def __init__(self, spec: PolicySpec, ctx: PolicyContext, fixed_decode_url: str | None = None,
                 local_prefill: bool = True):
        self.ctx = ctx
        # SGLang: a decode server in disaggregation mode serves only PD requests (it never
        # prefills a prompt itself). Append-prefill maps onto its radix cache instead: the turn
        # still goes PD, to the pinned decode, which reports its cached prefix to the prefill
        # (decode_prefix_len) so only the new pages move.
        self.local_prefill = local_prefill
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
        # Conversation tracking (routers/sessions.py) costs a table lookup per request: only then.
        self.uses_sessions = any(getattr(p, "uses_sessions", False) for p in pieces)
        # ELDR: the decode is chosen again once the prefill has reported the expert signature.
        self.uses_expert_signatures = any(getattr(p, "uses_expert_signatures", False)
                                          for p in pieces)

    def admit(self, request: RequestInfo, decision: Decision | None = None) -> Rejection | None:
        """The admission step on the route `schedule` chose for the request (`decision`; None:
        scheduled here first). The route matters: a request the deciders leave on its decode
        worker never waits in the prefill pool's queues."""
        if self.admission is None:
            return None
        if decision is None:
            decision = self.schedule(request)
        return self.admission.admit(request, decision)

    def choose_decode(self, request: RequestInfo, exclude: Collection) -> Choice | None:
        candidates = self.ctx.pool.usable("decode")
        if exclude:
            candidates = [w for w in candidates if w not in exclude]
        candidates = serving_adapter(request, candidates)
        if self.fixed_decode_url is not None:
            candidates = [w for w in candidates if w.url == self.fixed_decode_url]
            return Choice(candidates[0], "sidecar") if candidates else None
        return self.decode.choose(request, candidates)

    def choose_prefill(self, request: RequestInfo, decode_choice: Choice,
                       exclude: Collection) -> tuple[Choice | None, str]:
        """The prefill worker, or None with the reason the decode worker prefills locally."""
        usable = self.ctx.pool.usable("prefill")
        if exclude:
            usable = [w for w in usable if w not in exclude]
        candidates = serving_adapter(request, usable)
        if usable and not candidates and self.local_prefill:
            return None, f"no prefill worker serves adapter {request.adapter!r}"
        for name, decider in self.deciders if self.local_prefill else ():
            go, why = decider.disaggregate(request, decode_choice.worker, candidates)
            if not go:
                return None, f"{name}: {why}"
        if not candidates:
            return None, "no usable prefill worker"
        return self.prefill.choose(request, candidates), ""

    def rebind_decode(self, request: RequestInfo, decision: Decision,
                      exclude: Collection = frozenset()) -> Decision:
        """Choose the decode worker again now that the prefill has answered (its expert
        signature is in `request`); the prefill stays. Only for pull-style flows, where the
        decode leg starts after the prefill's answer."""
        if self.fixed_decode_url is not None or request.expert_histogram is None:
            return decision
        choice = self.choose_decode(request, exclude)
        if choice is None or choice.worker is decision.decode:
            return decision
        return Decision(choice.worker, decision.prefill,
                        [*decision.reasons, f"decode (experts known): {choice.reason}"])

    def schedule(self, request: RequestInfo, exclude_prefill: Collection = frozenset(),
                 exclude_decode: Collection = frozenset()) -> Decision | None:
        decode = self.choose_decode(request, exclude_decode)
        if decode is None:
            return None
        prefill, why_local = self.choose_prefill(request, decode, exclude_prefill)
        reasons = [f"decode: {decode.reason}"]
        if prefill is None and not self.local_prefill:
            return None  # nowhere to prefill: the caller answers 503
        if prefill is None:
            reasons.append(f"local prefill: {why_local}")
            return Decision(decode.worker, None, reasons)
        reasons.append(f"prefill: {prefill.reason}")
        return Decision(decode.worker, prefill.worker, reasons)


