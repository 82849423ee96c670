"""The routing rules of the peers users would pick instead, as pieces one harness can compare.

Each piece re-implements a peer's published decision rule on the signals Worker and PrefixIndex
expose; scheduler.py assembles them into the PEER_PRESETS. Sources read (paths in the peers' code):

- vllm_kv_aware: vllm-router 0.1.17 (its PyPI sdist), src/routers/http/pd_router.rs `select_stage`
  and src/policies/kv_aware.rs (`cost_components`, `credited_tokens`, `pick_prefill`,
  `pick_decode`).
- sglang_cache_aware: sglang-router 0.3.2 (its PyPI sdist), src/policies/cache_aware.rs
  `select_worker`, src/routers/http/pd_router.rs, src/routers/factory.rs; defaults from
  bindings/python/src/sglang_router/router_args.py.
- queue_depth: llm-d-inference-scheduler pkg/epp/framework/plugins/scheduling/scorer/queuedepth.
- mooncake_ttft, mooncake_slo: Mooncake (FAST'25), Algorithm 1 "KVCache-centric scheduling".
"""

from __future__ import annotations

from typing import Literal

from pd_plugins.routers.policy.base import (
    Count, Factor, Params, PolicyContext, RequestInfo, Share, normalise_lower_is_better,
    parse_params, register, register_plain,
)
from pd_plugins.routers.policy.ttft import SloAdmission, SloParams, TtftEstimator, TtftScorer


class VllmKvAwareParams(Params):
    decode: bool = False            # the decode pool: fewest requests, ties in turn
    batch_factor: bool = False      # the colocated rule: cost * (active_requests + 1)


class VllmKvAwareScorer:
    """vllm-router 0.1.17 `kv_aware` in PD mode (`--vllm-pd-disaggregation --policy kv_aware`).

    Prefill pool (pd_router.rs `select_stage`): cost = new_prefill_tokens + active_prefill_tokens,
    argmin, ties to the fewer prefill requests in flight, then to the first worker (`pick_prefill`,
    Rust `min_by`). new_prefill_tokens = prompt tokens minus the KV-event prefix credit, where the
    block that ends at the prompt's last token is never credited (kv_aware.rs `credited_tokens`:
    vLLM recomputes that token for its logits). The multiplicative
    (new + active) * (active_requests + 1) cost (kv_aware.rs `MultiplicativeScorer`) is the
    colocated, non-PD path: `batch_factor: true`.
    Decode pool (`select_decode` -> `pick_decode`): no prefix lookup at all; the fewest requests
    (pending + active decodes), equal loads taken in turn (a rotating cursor, as our max_score
    picker does). Session affinity is off unless its TTL is set. Load is the router's own count.
    """

    def __init__(self, params: VllmKvAwareParams, ctx: PolicyContext) -> None:
        self.params, self.ctx = params, ctx
        self.uses_prefix_index = not params.decode

    def new_prefill_tokens(self, request: RequestInfo, worker) -> int:
        n, block = request.prompt_tokens, self.ctx.block_size
        matched = self.ctx.prefix_index.matched_blocks(worker.url, request.block_keys)
        return n - min(matched, max(0, n - 1) // block) * block

    def costs(self, request: RequestInfo, workers: list) -> list[float]:
        if self.params.decode:
            return [float(w.in_flight) for w in workers]
        costs = []
        for w in workers:
            cost = self.new_prefill_tokens(request, w) + w.in_flight_prefill_tokens
            costs.append(float(cost * (w.in_flight + 1) if self.params.batch_factor else cost))
        return costs

    def score(self, request: RequestInfo, workers: list) -> list[float]:
        costs = self.costs(request, workers)
        if not self.params.decode:
            # Integer token costs: a fraction below one token orders ties by (in flight, order).
            rank = {w: i for i, w in enumerate(sorted(workers, key=lambda w: w.ordinal))}
            top, n = max(w.in_flight for w in workers) + 1, len(workers)
            costs = [c + (w.in_flight + rank[w] / n) / top for c, w in zip(costs, workers)]
        return normalise_lower_is_better(costs)


class CacheAwareParams(Params):
    cache_threshold: Share = 0.3
    balance_abs_threshold: Count = 64
    balance_rel_threshold: Factor = 1.5
    # 0.3.2 sends a low match to the least loaded worker; older sglang-routers (and the comment
    # atop cache_aware.rs) to the worker with the smallest tree.
    low_match: Literal["min_load", "smallest_tree"] = "min_load"


class SglangCacheAwareScorer:
    """sglang-router 0.3.2 `cache_aware` (cache_aware.rs `select_worker`); 1.0 for its choice.

    load = requests the router has in flight on the worker (`Worker::load`, its own counter).
    If max - min > balance_abs_threshold and max > balance_rel_threshold * min: the least loaded
    (first of equals). Else the best prefix match over the worker's tree (our prefix index of the
    prompts routed there); match rate = matched tokens / prompt tokens; above cache_threshold the
    worker holding it, otherwise the least loaded (or the smallest tree, `low_match`). In PD mode
    the decode pool runs the same policy with its own tree (routers/factory.rs makes one instance
    per pool from `--policy` unless --prefill-policy / --decode-policy are given).
    """

    uses_prefix_index = True

    def __init__(self, params: CacheAwareParams, ctx: PolicyContext) -> None:
        self.params, self.ctx = params, ctx

    def choose(self, request: RequestInfo, workers: list):
        p, index = self.params, self.ctx.prefix_index
        ordered = sorted(workers, key=lambda w: w.ordinal)
        loads = [w.in_flight for w in ordered]
        low, high = min(loads), max(loads)
        least_loaded = ordered[loads.index(low)]
        if high - low > p.balance_abs_threshold and high > low * p.balance_rel_threshold:
            return least_loaded
        matched = [index.matched_blocks(w.url, request.block_keys) for w in ordered]
        best = max(matched)
        rate = best * self.ctx.block_size / request.prompt_tokens if request.prompt_tokens else 0.0
        if rate > p.cache_threshold:
            return ordered[matched.index(best)]
        if p.low_match == "smallest_tree":
            held = [index.held_blocks(w.url) for w in ordered]
            return ordered[held.index(min(held))]
        return least_loaded

    def score(self, request: RequestInfo, workers: list) -> list[float]:
        chosen = self.choose(request, workers)
        return [1.0 if w is chosen else 0.0 for w in workers]


class QueueDepthScorer:
    """llm-d `queue-scorer`: the engine's waiting queue, min-max normalised (all equal: 1)."""

    def score(self, request: RequestInfo, workers: list) -> list[float]:
        return normalise_lower_is_better([w.engine_waiting for w in workers])


KVCACHE_BALANCING_THRESHOLD = 2.0  # the paper names the knob but publishes no value


class MooncakeEstimator(TtftEstimator):
    """Mooncake Algorithm 1's TTFT of one prefill instance.

    best = the longest prefix any usable prefill instance holds (global cache view), local = this
    instance's. If best / local < kvcache_balancing_threshold: queue + prefill(prompt, local).
    Otherwise fetch the missing best - local blocks from the holder first:
    transfer(best - local) + queue + prefill(prompt, best). (Plus the P->D transfer TtftEstimator
    adds to every instance alike.)
    """

    def __init__(self, ctx: PolicyContext, threshold: float) -> None:
        super().__init__(ctx)
        self.threshold = threshold

    def estimate_s(self, request: RequestInfo, worker) -> float:
        index, pool, block = self.ctx.prefix_index, self.ctx.pool, self.ctx.block_size
        local_s = super().estimate_s(request, worker)
        local = index.matched_blocks(worker.url, request.block_keys)
        best = max(index.matched_blocks(w.url, request.block_keys)
                   for w in pool.usable("prefill") or [worker])
        if best <= local or best < self.threshold * local:
            return local_s
        model = self.ctx.latency
        return (local_s - model.prefill_s(self.uncached_tokens(request, worker))
                + model.prefill_s(max(1, request.prompt_tokens - best * block))
                + model.transfer_s((best - local) * block))


class MooncakeParams(Params):
    kvcache_balancing_threshold: Factor = KVCACHE_BALANCING_THRESHOLD


class MooncakeTtftScorer(TtftScorer):
    """Mooncake Conductor's prefill choice: the least Algorithm-1 TTFT (best / estimate)."""

    def __init__(self, params: MooncakeParams, ctx: PolicyContext) -> None:
        self.estimator = MooncakeEstimator(ctx, params.kvcache_balancing_threshold)


class MooncakeSloParams(SloParams):
    kvcache_balancing_threshold: Factor = KVCACHE_BALANCING_THRESHOLD


class MooncakeSloAdmission(SloAdmission):
    """The `slo` admission (429 over the TTFT or TBT SLO) judging the Algorithm-1 TTFT."""

    def __init__(self, params: MooncakeSloParams, ctx: PolicyContext) -> None:
        super().__init__(params, ctx)
        self.estimator = MooncakeEstimator(ctx, params.kvcache_balancing_threshold)


@register("scorer", "vllm_kv_aware")
def _vllm_kv_aware(params, ctx):
    return VllmKvAwareScorer(parse_params(params, VllmKvAwareParams, "scorer vllm_kv_aware"), ctx)


@register("scorer", "sglang_cache_aware")
def _sglang_cache_aware(params, ctx):
    parsed = parse_params(params, CacheAwareParams, "scorer sglang_cache_aware")
    return SglangCacheAwareScorer(parsed, ctx)


register_plain("scorer", "queue_depth", lambda ctx: QueueDepthScorer())


@register("scorer", "mooncake_ttft")
def _mooncake_ttft(params, ctx):
    return MooncakeTtftScorer(parse_params(params, MooncakeParams, "scorer mooncake_ttft"), ctx)


@register("admission", "mooncake_slo")
def _mooncake_slo(params, ctx):
    parsed = parse_params(params, MooncakeSloParams, "admission mooncake_slo")
    return MooncakeSloAdmission(parsed, ctx)
