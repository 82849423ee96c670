"""The peers' routing rules (policy/peers.py and the PEER_PRESETS), on hand-set worker state."""

import pytest

from pd_plugins.routers.policy import preset
from pd_plugins.routers.policy.base import build
from pd_plugins.routers.policy.scheduler import PEER_PRESETS, PREFIX_SOURCE, PRESETS, Scheduler
from tests.unit.routers.helpers import BLOCK, context, learn_priors, request

PROMPT = list(range(100, 132))      # 32 tokens = 8 blocks of 4
PROMPT40 = list(range(200, 240))    # 40 tokens = 10 blocks
LONG = list(range(1000, 1400))      # 400 tokens = 100 blocks


# -- vllm-router kv_aware -------------------------------------------------------------------------
def test_vllm_kv_aware_prefill_cost_beats_naive_least_loaded():
    ctx = context()
    a, b = ctx.pool.by_role("prefill")
    req = request(PROMPT)
    ctx.prefix_index.record_routed(a.url, req.block_keys)  # all 8 blocks; the last is not credited
    a.in_flight, a.in_flight_prefill_tokens = 3, 10
    b.in_flight, b.in_flight_prefill_tokens = 1, 20
    pd_rule = build("scorer", "vllm_kv_aware", {}, ctx)
    assert pd_rule.new_prefill_tokens(req, a) == 4           # 32 - 7 * 4
    assert pd_rule.costs(req, [a, b]) == [14.0, 52.0]        # new + active prefill tokens
    assert pd_rule.score(req, [a, b])[0] == 1.0
    colocated = build("scorer", "vllm_kv_aware", {"batch_factor": True}, ctx)
    assert colocated.costs(req, [a, b]) == [56.0, 104.0]     # x (active requests + 1)
    assert build("scorer", "least_loaded", {}, ctx).score(req, [a, b]) == [0.0, 1.0]


def test_vllm_kv_aware_credits_every_full_block_of_a_ragged_prompt():
    ctx = context()
    a = ctx.pool.by_role("prefill")[0]
    req = request(PROMPT[:30])  # 7 full blocks + 2 tokens: the 7th block does not end the prompt
    ctx.prefix_index.record_routed(a.url, req.block_keys)
    assert build("scorer", "vllm_kv_aware", {}, ctx).new_prefill_tokens(req, a) == 2


def test_vllm_kv_aware_prefill_ties_go_to_fewer_in_flight_then_the_first_worker():
    ctx = context()
    a, b = ctx.pool.by_role("prefill")
    scorer = build("scorer", "vllm_kv_aware", {}, ctx)
    a.in_flight, b.in_flight = 2, 1  # equal token costs (32 each)
    scores = scorer.score(request(PROMPT), [a, b])
    assert scores[1] == 1.0 and scores[0] < 1.0
    a.in_flight = 1
    scores = scorer.score(request(PROMPT), [b, a])  # candidate order does not matter: a came first
    assert scores[1] == 1.0 and scores[0] < 1.0


def test_vllm_kv_aware_decode_ignores_prefixes_and_rotates_equal_loads():
    ctx = context()
    p0, _ = ctx.pool.by_role("prefill")
    d0, d1 = ctx.pool.by_role("decode")
    req = request(PROMPT)
    ctx.prefix_index.record_routed(d0.url, req.block_keys)
    ctx.prefix_index.record_routed(p0.url, req.block_keys)
    d0.in_flight = 2
    scheduler = Scheduler(preset("vllm_kv_aware"), ctx)
    decision = scheduler.schedule(req)
    assert decision.decode is d1 and decision.prefill is p0  # always disaggregated
    d0.in_flight = 0
    assert {scheduler.schedule(req).decode for _ in range(2)} == {d0, d1}


# -- sglang-router cache_aware --------------------------------------------------------------------
@pytest.mark.parametrize("loads, imbalanced", [
    ((200, 100), True),     # both thresholds exceeded
    ((134, 70), False),     # difference 64 is not > 64
    ((135, 70), True),      # difference 65
    ((300, 200), False),    # 300 is not > 1.5 * 200
    ((301, 200), True),
])
def test_sglang_cache_aware_shortest_queue_only_when_both_thresholds_are_exceeded(loads, imbalanced):
    ctx = context()
    a, b = ctx.pool.by_role("prefill")
    req = request(PROMPT)
    ctx.prefix_index.record_routed(a.url, req.block_keys)  # a holds the whole prompt
    a.in_flight, b.in_flight = loads
    scores = build("scorer", "sglang_cache_aware", {}, ctx).score(req, [a, b])
    assert scores == ([0.0, 1.0] if imbalanced else [1.0, 0.0])


@pytest.mark.parametrize("held_blocks, to_match", [(3, True), (2, False)])
def test_sglang_cache_aware_best_match_above_the_threshold(held_blocks, to_match):
    ctx = context()
    a, b = ctx.pool.by_role("prefill")
    req = request(PROMPT)
    ctx.prefix_index.record_routed(b.url, req.block_keys[:held_blocks])  # 12/32 or 8/32 tokens
    b.in_flight = 1
    scores = build("scorer", "sglang_cache_aware", {}, ctx).score(req, [a, b])
    assert scores == ([0.0, 1.0] if to_match else [1.0, 0.0])


def test_sglang_cache_aware_match_rate_must_exceed_the_threshold_strictly():
    ctx = context()
    a, b = ctx.pool.by_role("prefill")
    req = request(PROMPT40)
    ctx.prefix_index.record_routed(b.url, req.block_keys[:3])  # 12/40 = 0.3 exactly
    b.in_flight = 1
    scorer = build("scorer", "sglang_cache_aware", {}, ctx)
    assert scorer.score(req, [a, b]) == [1.0, 0.0]
    assert build("scorer", "sglang_cache_aware", {"cache_threshold": 0.29}, ctx).score(
        req, [a, b]) == [0.0, 1.0]


def test_sglang_cache_aware_low_match_goes_to_least_loaded_or_emptiest_tree():
    ctx = context()
    a, b = ctx.pool.by_role("prefill")
    req = request(PROMPT40)
    ctx.prefix_index.record_routed(a.url, req.block_keys[:2])  # the best match, 0.2
    ctx.prefix_index.record_routed(a.url, request(LONG[:40]).block_keys)
    ctx.prefix_index.record_routed(b.url, request(LONG[100:120]).block_keys)
    assert (ctx.prefix_index.held_blocks(a.url), ctx.prefix_index.held_blocks(b.url)) == (12, 5)
    b.in_flight = 1
    assert build("scorer", "sglang_cache_aware", {}, ctx).score(req, [a, b]) == [1.0, 0.0]
    smallest_tree = build("scorer", "sglang_cache_aware", {"low_match": "smallest_tree"}, ctx)
    assert smallest_tree.score(req, [a, b]) == [0.0, 1.0]


def test_sglang_cache_aware_decode_pool_uses_its_own_tree():
    ctx = context()
    d0, d1 = ctx.pool.by_role("decode")
    req = request(PROMPT)
    ctx.prefix_index.record_routed(d1.url, req.block_keys)
    d1.in_flight = 5
    decision = Scheduler(preset("sglang_cache_aware"), ctx).schedule(req)
    assert decision.decode is d1 and decision.prefill is not None


# -- Dynamo ---------------------------------------------------------------------------------------
def test_dynamo_is_kv_cost_and_counts_the_queued_prefill_tokens():
    assert PRESETS["dynamo"] == PRESETS["kv_cost"]
    ctx = context()
    a, b = ctx.pool.by_role("prefill")
    req = request(PROMPT)
    ctx.prefix_index.record_routed(a.url, req.block_keys[:6])
    scorer = build("scorer", "kv_cost", {}, ctx)
    a.in_flight_prefill_tokens = 4 * BLOCK
    assert scorer.costs(req, [a, b]) == [6.0, 8.0]   # max(0, 4 + 8 - 6) vs 8
    a.in_flight_prefill_tokens = 16 * BLOCK
    assert scorer.costs(req, [a, b]) == [18.0, 8.0]  # the queue outweighs the overlap
    assert Scheduler(preset("dynamo"), ctx).schedule(req).prefill is b


# -- llm-d ----------------------------------------------------------------------------------------
def test_llm_d_queue_scorer_reads_the_engine_waiting_queue():
    ctx = context()
    a, b = ctx.pool.by_role("prefill")
    a.engine_waiting, b.engine_waiting = 5, 1
    b.in_flight = 10
    assert build("scorer", "queue_depth", {}, ctx).score(request(PROMPT), [a, b]) == [0.0, 1.0]


def test_llm_d_decode_profile_scores_prefixes_and_decider_keeps_cached_prompts_local():
    ctx = context()
    d0, d1 = ctx.pool.by_role("decode")
    req = request(PROMPT)
    ctx.prefix_index.record_routed(d0.url, req.block_keys)
    d0.engine_waiting = 3
    decision = Scheduler(preset("llm_d"), ctx).schedule(req)
    assert decision.decode is d0 and decision.prefill is None  # 2 * 1 + 0 beats 0 + 1; 0 uncached
    assert Scheduler(preset("prefix_cache"), ctx).schedule(req).decode is d1  # ours: load only


# -- Mooncake -------------------------------------------------------------------------------------
def mooncake_context(**latency):
    # prefill 0.01 s + 1 ms/token; KV moves at 0.1 ms/token (P->D and remote prefix alike)
    return context(prefill_base_s=0.01, prefill_per_token_s=0.001, kv_bytes_per_token=1000,
                   link_bytes_per_s=1e7, **latency)


def test_mooncake_fetches_a_remote_prefix_when_that_is_faster():
    ctx = mooncake_context()
    a, b = ctx.pool.by_role("prefill")
    req = request(LONG)
    ctx.prefix_index.record_routed(a.url, req.block_keys)
    a.in_flight, a.in_flight_prefill_tokens = 2, 200  # queue 0.22 s
    plain = build("scorer", "ttft", {}, ctx).score(req, [a, b])
    assert plain[0] == 1.0 and plain[1] < 1.0  # local estimates: a 0.271 s, b 0.45 s
    mooncake = build("scorer", "mooncake_ttft", {}, ctx)
    assert mooncake.estimator.estimate_s(req, a) == pytest.approx(0.271)
    assert mooncake.estimator.estimate_s(req, b) == pytest.approx(0.091)  # fetch 400 tokens: 0.04
    assert mooncake.score(req, [a, b])[1] == 1.0
    assert Scheduler(preset("mooncake"), ctx).schedule(req).prefill is b


def test_mooncake_balancing_threshold_decides_between_fetch_and_recompute():
    ctx = mooncake_context()
    a, b = ctx.pool.by_role("prefill")
    req = request(LONG)
    ctx.prefix_index.record_routed(a.url, req.block_keys)       # best: 100 blocks
    ctx.prefix_index.record_routed(b.url, req.block_keys[:60])  # 100 / 60 = 1.67
    recompute = build("scorer", "mooncake_ttft", {"kvcache_balancing_threshold": 2.0}, ctx)
    fetch = build("scorer", "mooncake_ttft", {"kvcache_balancing_threshold": 1.5}, ctx)
    assert recompute.estimator.estimate_s(req, b) == pytest.approx(0.17 + 0.04)
    assert fetch.estimator.estimate_s(req, b) == pytest.approx(0.011 + 0.016 + 0.04)


def test_mooncake_rejects_with_429_over_the_ttft_slo_judged_by_its_own_estimate():
    ctx = learn_priors(mooncake_context())  # fitted: the `slo` refusal below is from the idle b
    a, _ = ctx.pool.by_role("prefill")
    req = request(LONG)
    ctx.prefix_index.record_routed(a.url, req.block_keys)
    a.in_flight, a.in_flight_prefill_tokens = 2, 200
    # best local estimate 0.271 s, best with a fetch 0.091 s
    assert build("admission", "slo", {"ttft_slo_ms": 150}, ctx).admit(req).status == 429
    assert build("admission", "mooncake_slo", {"ttft_slo_ms": 150}, ctx).admit(req) is None
    rejection = build("admission", "mooncake_slo", {"ttft_slo_ms": 50}, ctx).admit(req)
    assert rejection.status == 429 and "TTFT 91 ms" in rejection.message


def test_mooncake_rejects_with_429_over_the_tbt_slo():
    ctx = mooncake_context(decode_step_base_s=0.01, decode_step_per_request_s=0.01)
    scheduler = Scheduler(preset("mooncake"), ctx)  # TTFT SLO 2 s, TBT SLO 100 ms
    assert scheduler.admit(request(PROMPT)) is None
    for w in ctx.pool.by_role("decode"):
        w.in_flight = 9  # next step with 10 requests: 0.11 s
    rejection = scheduler.admit(request(PROMPT))
    assert rejection.status == 429 and "TPOT 110 ms" in rejection.message


# -- the harness's list ---------------------------------------------------------------------------
def test_every_peer_preset_builds_and_schedules_and_names_its_prefix_source():
    assert set(PEER_PRESETS) <= set(PREFIX_SOURCE)  # (plus vllm_session_affinity, multi-turn studies)
    assert set(PREFIX_SOURCE.values()) <= {"events", "routed"}
    for name in PEER_PRESETS:
        ctx = context()
        scheduler = Scheduler(preset(name), ctx)
        assert scheduler.admit(request(PROMPT)) is None
        decision = scheduler.schedule(request(PROMPT))
        assert decision is not None and decision.prefill is not None, name
