"""Every built-in policy piece, deterministic, on hand-set worker state."""

import pytest

from pd_plugins.routers.config import ConfigError
from pd_plugins.routers.policy import preset
from pd_plugins.routers.policy.base import build, registered
from pd_plugins.routers.policy.scheduler import Scheduler
from tests.unit.routers.helpers import BLOCK, context, learn_priors, request

PROMPT = list(range(100, 132))  # 32 tokens = 8 blocks of 4


def test_least_loaded_prefers_fewer_in_flight_and_uses_engine_queue():
    ctx = context()
    a, b = ctx.pool.by_role("prefill")
    a.in_flight, b.in_flight = 3, 1
    scorer = build("scorer", "least_loaded", {}, ctx)
    assert scorer.score(request(PROMPT), [a, b]) == [0.0, 1.0]
    b.engine_waiting = 10  # another client loads b: its engine queue wins over our count
    assert scorer.score(request(PROMPT), [a, b]) == [1.0, 0.0]


def test_kv_usage_scorer():
    ctx = context()
    a, b = ctx.pool.by_role("decode")
    a.kv_usage, b.kv_usage = 0.9, 0.25
    assert build("scorer", "kv_usage", {}, ctx).score(request(PROMPT), [a, b]) == pytest.approx([0.1, 0.75])


def test_prefix_cache_scores_share_of_leading_blocks_held():
    ctx = context()
    a, b = ctx.pool.by_role("prefill")
    req = request(PROMPT)
    ctx.prefix_index.record_routed(a.url, req.block_keys[:6])
    ctx.prefix_index.record_routed(b.url, req.block_keys[2:])  # not a prefix: worth nothing
    assert build("scorer", "prefix_cache", {}, ctx).score(req, [a, b]) == [0.75, 0.0]


def test_kv_cost_follows_dynamo_formula():
    ctx = context()
    a, b = ctx.pool.by_role("prefill")
    req = request(PROMPT)  # 8 blocks
    ctx.prefix_index.record_routed(a.url, req.block_keys[:6])
    a.in_flight_tokens = 5 * BLOCK  # 5 active blocks
    scorer = build("scorer", "kv_cost", {"prefill_load_scale": 2.0}, ctx)
    # a: 2 * (8 - 6) + 5 = 9; b: 2 * 8 + 0 = 16
    assert scorer.costs(req, [a, b]) == [9.0, 16.0]
    assert scorer.score(req, [a, b]) == [1.0, 0.0]
    no_overlap = build("scorer", "kv_cost", {"use_overlap": False}, ctx)
    assert no_overlap.costs(req, [a, b]) == [13.0, 8.0]


def test_ttft_scorer_prefers_cached_and_idle_worker():
    ctx = context(prefill_base_s=0.01, prefill_per_token_s=0.001)
    a, b = ctx.pool.by_role("prefill")
    req = request(PROMPT)
    ctx.prefix_index.record_routed(a.url, req.block_keys)  # a holds all 32 tokens: 1 left
    scores = build("scorer", "ttft", {}, ctx).score(req, [a, b])
    assert scores[0] == 1.0 and scores[1] == pytest.approx(0.011 / 0.042)
    a.in_flight, a.in_flight_prefill_tokens = 4, 400  # a queue of 0.04 + 0.4 s
    scores = build("scorer", "ttft", {}, ctx).score(req, [a, b])
    assert scores[1] == 1.0 and scores[0] < 0.1


def test_max_score_picker_round_robins_ties():
    ctx = context()
    a, b = ctx.pool.by_role("decode")
    picker = build("picker", "max_score", {}, ctx)
    assert {picker.pick([a, b], [1.0, 1.0]).url for _ in range(4)} == {a.url, b.url}
    assert all(picker.pick([a, b], [0.2, 0.9]) is b for _ in range(4))


def test_round_robin_picker_ignores_scores():
    ctx = context()
    a, b = ctx.pool.by_role("decode")
    picker = build("picker", "round_robin", {}, ctx)
    assert [picker.pick([b, a], [0.0, 9.0]) for _ in range(4)] == [a, b, a, b]


def test_random_picker_is_seeded_and_follows_weights():
    ctx = context()
    a, b = ctx.pool.by_role("decode")
    picks = [build("picker", "random", {"seed": 7}, ctx).pick([a, b], [0.0, 1.0]) for _ in range(5)]
    assert all(p is b for p in picks)


def test_not_saturated_filter_skips_full_workers_unless_all_are():
    ctx = context()
    a, b = ctx.pool.by_role("decode")
    flt = build("filter", "not_saturated", {"max_waiting": 4}, ctx)
    a.engine_waiting = 10
    assert flt.filter(request(PROMPT), [a, b]) == [b]
    b.kv_usage = 1.0
    assert flt.filter(request(PROMPT), [a, b]) == [a, b]


def test_uncached_length_decider():
    ctx = context()
    decode = ctx.pool.by_role("decode")[0]
    decider = build("decider", "uncached_length", {"min_uncached_tokens": 8}, ctx)
    req = request(PROMPT)
    assert decider.disaggregate(req, decode, ctx.pool.by_role("prefill"))[0] is True
    ctx.prefix_index.record_routed(decode.url, req.block_keys[:7])  # 4 tokens left
    go, why = decider.disaggregate(req, decode, ctx.pool.by_role("prefill"))
    assert go is False and "4 < 8" in why


def test_prefill_load_decider_converts_decode_when_prefill_pool_is_saturated():
    ctx = context(prefill_base_s=0.01, prefill_per_token_s=0.001)
    decode = ctx.pool.by_role("decode")[0]
    prefills = ctx.pool.by_role("prefill")
    decider = build("decider", "prefill_load", {"min_prefill_queue": 2}, ctx)
    req = request(PROMPT)
    assert decider.disaggregate(req, decode, prefills)[0] is True
    for w in prefills:
        w.in_flight, w.in_flight_prefill_tokens = 6, 3000
    go, why = decider.disaggregate(req, decode, prefills)
    assert go is False and "saturated" in why


def test_prefill_load_decider_spares_a_decode_worker_whose_kv_is_full():
    ctx = context(prefill_base_s=0.01, prefill_per_token_s=0.001)
    decode = ctx.pool.by_role("decode")[0]
    prefills = ctx.pool.by_role("prefill")
    for w in prefills:
        w.in_flight, w.in_flight_prefill_tokens = 6, 3000
    decider = build("decider", "prefill_load", {"max_decode_kv_usage": 0.7}, ctx)
    decode.kv_usage = 0.69
    assert decider.disaggregate(request(PROMPT), decode, prefills)[0] is False
    decode.kv_usage = 0.7
    go, why = decider.disaggregate(request(PROMPT), decode, prefills)
    assert go is True and "decode KV 70% full" in why


def test_slo_admission_rejects_while_every_decode_kv_cache_is_full():
    ctx = context()
    admission = build("admission", "slo", {"ttft_slo_ms": 10_000, "decode_kv_limit": 0.9}, ctx)
    d0, d1 = ctx.pool.by_role("decode")
    d0.kv_usage = 0.95
    assert admission.admit(request(PROMPT)) is None  # d1 still has room
    d1.engine_waiting = 1  # a queue on a nearly empty cache: requests pulling their KV
    assert admission.admit(request(PROMPT)) is None
    d1.kv_usage = 0.5  # half full and queueing: no room either
    rejection = admission.admit(request(PROMPT))
    assert rejection.status == 429 and "90% full or queueing" in rejection.message
    d1.engine_waiting = 0
    assert admission.admit(request(PROMPT)) is None


def test_slo_admission_rejects_with_retry_after():
    ctx = context(prefill_base_s=0.01, prefill_per_token_s=0.01)
    admission = build("admission", "slo", {"ttft_slo_ms": 500}, ctx)
    assert admission.admit(request(PROMPT)) is None  # 0.33 s
    for w in ctx.pool.by_role("prefill"):
        w.in_flight, w.in_flight_prefill_tokens = 3, 300  # + 3.03 s queue
    rejection = admission.admit(request(PROMPT))
    assert rejection.status == 429 and rejection.retry_after_s == 3.0
    assert "exceeds the 500 ms SLO" in rejection.message


def test_slo_admission_sends_no_retry_after_when_the_prompt_alone_misses_the_slo():
    """An idle cluster and a prompt whose own prefill misses the SLO: the Retry-After promised
    a wait that cannot help (every retry was refused the same way)."""
    ctx = learn_priors(context(prefill_base_s=0.01, prefill_per_token_s=0.01))
    admission = build("admission", "slo", {"ttft_slo_ms": 300}, ctx)
    rejection = admission.admit(request(PROMPT))  # 0.33 s with nothing queued
    assert rejection.status == 429 and rejection.retry_after_s is None
    assert "exceeds the 300 ms SLO" in rejection.message and "alone takes 330 ms" in rejection.message
    # the same prompt behind a queue, where it alone would make it: wait and retry
    admission = build("admission", "slo", {"ttft_slo_ms": 500}, ctx)
    for w in ctx.pool.by_role("prefill"):
        w.in_flight, w.in_flight_prefill_tokens = 3, 300
    assert admission.admit(request(PROMPT)).retry_after_s == 3.0
    # TPOT alike: a step of one request over the SLO is no matter of load
    ctx = learn_priors(context(decode_step_base_s=0.06, decode_step_per_request_s=0.01))
    rejection = build("admission", "slo", {"ttft_slo_ms": 10_000, "tpot_slo_ms": 50},
                      ctx).admit(request(PROMPT))
    assert rejection.status == 429 and rejection.retry_after_s is None and "TPOT" in rejection.message


def test_slo_admission_refuses_on_the_priors_only_what_a_retry_can_fix():
    """A fresh router on the shipped priors (20 ms + 0.2 ms per token) refused every prompt over
    ~7,400 tokens at 1.5 s on an idle cluster, for good: a refused request gives the fit no
    sample. On the priors a refusal is only for the queue ahead."""
    ctx = context()
    admission = build("admission", "slo", {"ttft_slo_ms": 1500}, ctx)
    long = request(list(range(32_000)))  # 6.4 s alone on the priors
    assert admission.admit(long) is None
    p0, p1 = ctx.pool.by_role("prefill")
    for w in (p0, p1):
        w.in_flight, w.in_flight_prefill_tokens = 2, 6000  # 1.24 s queued on each
    assert admission.admit(long) is None
    rejection = admission.admit(request(list(range(2000))))  # 0.42 s alone: the queue decides
    assert rejection.status == 429 and rejection.retry_after_s == 1.0
    fit = ctx.latency.prefill
    for i in range(fit.min_samples):  # the legs ran at the prior's speed: now a verdict
        assert admission.admit(long) is None, i
        fit.observe(1000 * (i + 1), 0.02 + 0.0002 * 1000 * (i + 1))
    rejection = admission.admit(long)
    assert rejection.status == 429 and rejection.retry_after_s is None


def test_slo_admission_checks_tpot():
    ctx = context(decode_step_base_s=0.01, decode_step_per_request_s=0.01)
    admission = build("admission", "slo", {"ttft_slo_ms": 10_000, "tpot_slo_ms": 50}, ctx)
    assert admission.admit(request(PROMPT)) is None
    for w in ctx.pool.by_role("decode"):
        w.in_flight = 8
    assert "TPOT" in admission.admit(request(PROMPT)).message


def test_scheduler_sidecar_exclusions_and_local_prefill():
    ctx = context()
    spec = preset("least_loaded")
    d0, d1 = ctx.pool.by_role("decode")
    p0, p1 = ctx.pool.by_role("prefill")
    sidecar = Scheduler(spec, ctx, fixed_decode_url=d1.url)
    assert all(sidecar.schedule(request(PROMPT)).decode is d1 for _ in range(3))
    gateway = Scheduler(spec, ctx)
    decision = gateway.schedule(request(PROMPT), exclude_prefill={p0}, exclude_decode={d0})
    assert decision.decode is d1 and decision.prefill is p1
    decision = gateway.schedule(request(PROMPT), exclude_prefill={p0, p1})
    assert decision.prefill is None and "no usable prefill" in decision.reasons[-1]
    d0.healthy = d1.healthy = False
    assert gateway.schedule(request(PROMPT)) is None


def test_presets_build_and_unknown_names_fail_clearly():
    ctx = context()
    for name in ("round_robin", "least_loaded", "prefix_cache", "kv_cost", "ttft_slo"):
        assert Scheduler(preset(name), ctx).schedule(request(PROMPT)) is not None
    with pytest.raises(ConfigError, match="unknown scorer 'nope'"):
        build("scorer", "nope", {}, ctx)
    with pytest.raises(ConfigError, match="unknown field `weight_x`"):
        build("decider", "uncached_length", {"weight_x": 1}, ctx)


@pytest.mark.parametrize("kind, name", [(kind, name) for kind in
                                        ("filter", "scorer", "picker", "decider", "admission")
                                        for name in registered(kind)])
def test_every_piece_refuses_unknown_params(kind, name):
    # the pieces without parameters ignored whatever `params` held (docs: unknown keys fail)
    with pytest.raises(ConfigError, match=rf"{kind} {name} params: .*unknown field `x`"):
        build(kind, name, {"x": 1}, context())
