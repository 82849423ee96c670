"""The cluster simulator: one request timed by hand, determinism, and the router's policies at work."""

import dataclasses

import pytest

from pd_plugins.perf.cluster_sim import ClusterSim, SimConfig, simulate
from pd_plugins.perf.hardware import preset
from pd_plugins.perf.report import Slo, summarize
from pd_plugins.workloads import ConversationSpec, TraceRequest, generate_conversations

HW = preset("llama-3.1-8b@h100")


def test_one_request_through_prefill_transfer_and_decode_by_hand():
    net = 0.001
    req = TraceRequest(0, 0.0, input_tokens=1024, output_tokens=3, block_hashes=(11, 12))
    out = simulate([req], SimConfig(HW, 1, 1, policy="round_robin", leg_network_s=net)).outcomes[0]
    prefill = HW.prefill_s(1024)
    first = net + prefill + 2 * net + HW.transfer_s(1024) + HW.decode_step_s(1, 1024)
    assert out.status == "ok" and out.disaggregated
    assert out.ttft_s == pytest.approx(first + net)
    assert out.tpot_s == pytest.approx((HW.decode_step_s(1, 1025) + HW.decode_step_s(1, 1026)) / 2)
    assert out.transfer_tokens == 1024


def test_same_seed_same_result_and_the_result_depends_on_the_policy():
    # Busy enough that the policies' choices matter (the trace files may be absent on CI).
    reqs = generate_conversations(ConversationSpec(session_rate_per_s=4.0), n_sessions=100, seed=4)
    def run(policy, seed=0):
        r = simulate(reqs, SimConfig(HW, 2, 2, policy=policy, seed=seed))
        return [(o.status, o.ttft_s, o.tpot_s, o.prefill, o.decode) for o in r.outcomes]
    assert run("prefix_cache") == run("prefix_cache")
    assert run("round_robin") != run("prefix_cache")


def test_prefix_aware_routing_finds_more_cache_than_round_robin():
    # Sessions of many turns: each turn repeats the whole conversation so far.
    spec = ConversationSpec(session_rate_per_s=2.0, mean_turns=6, shared_system_tokens=0)
    reqs = generate_conversations(spec, n_sessions=60, seed=1)
    def hit_rate(policy):
        r = simulate(reqs, SimConfig(HW, 4, 2, policy=policy))
        return summarize(r.outcomes, Slo(2, 0.1), r.sim_span_s, cached_tokens=r.prompt_tokens_cached,
                         computed_tokens=r.prefill_tokens_computed,
                         kv_bytes_moved=r.kv_bytes_moved)["cache_hit_rate"]
    assert hit_rate("prefix_cache") > hit_rate("round_robin") + 0.2


def test_slo_admission_rejects_under_overload_and_everything_is_accounted_for():
    reqs = [TraceRequest(i, i * 0.01, 16_000, 20, tuple(range(i * 40, i * 40 + 32))) for i in range(300)]
    result = simulate(reqs, SimConfig(HW, 1, 1, policy="ttft_slo"))
    statuses = [o.status for o in result.outcomes]
    assert len(statuses) == 300 and set(statuses) <= {"ok", "rejected"}
    assert statuses.count("rejected") > 100 and statuses.count("ok") > 10


def test_multi_turn_appends_later_turns_on_the_pinned_decode_with_the_answer_cached():
    spec = ConversationSpec(session_rate_per_s=0.2, mean_turns=50, max_turns=3, shared_system_tokens=0,
                            user_tokens_range=(100, 300), assistant_tokens_range=(600, 900))
    reqs = generate_conversations(spec, n_sessions=4, seed=3)
    result = simulate(reqs, SimConfig(HW, 2, 2, policy="multi_turn"))
    by_id = {r.request_id: r for r in reqs}
    for o in result.outcomes:
        assert o.status == "ok"
        if o.turn == 0:
            assert o.disaggregated
            continue
        prev = next(r for r in reqs if r.session_id == o.session_id and r.turn == o.turn - 1)
        first = next(x for x in result.outcomes if x.request_id == prev.request_id)
        assert not o.disaggregated and o.decode == first.decode  # appended on its pinned decode
        # its prompt's full blocks up to the end of the last answer were cached there
        assert o.cached_tokens >= (prev.input_tokens + prev.output_tokens) // 512 * 512, by_id[o.request_id]
    plain = simulate(reqs, SimConfig(HW, 2, 2, policy="vllm_kv_aware"))
    assert all(o.disaggregated for o in plain.outcomes)


def test_block_size_must_match_the_requests_and_finer_blocks_recompute_less_of_an_append():
    spec = ConversationSpec(session_rate_per_s=0.2, mean_turns=50, max_turns=3, shared_system_tokens=0,
                            user_tokens_range=(100, 300), assistant_tokens_range=(600, 900))
    with pytest.raises(ValueError, match="16-token blocks"):
        simulate(generate_conversations(dataclasses.replace(spec, block_tokens=16), 2, seed=3),
                 SimConfig(HW, 2, 2, policy="multi_turn"))

    def recomputed(block):
        reqs = generate_conversations(dataclasses.replace(spec, block_tokens=block), 4, seed=3)
        result = simulate(reqs, SimConfig(HW, 2, 2, policy="multi_turn", block_tokens=block))
        later = [o for o in result.outcomes if o.turn > 0]
        assert later and all(o.status == "ok" and not o.disaggregated for o in later)
        # the history up to the end of the last answer is cached, to the last full block
        by_id = {r.request_id: r for r in reqs}
        assert all(o.cached_tokens >= by_id[o.request_id].input_tokens - 300 - block for o in later)
        return sum(by_id[o.request_id].input_tokens - o.cached_tokens for o in later)
    assert recomputed(16) < recomputed(512)


def test_decode_token_budget_applies_to_decode_instances_only():
    sim = ClusterSim(SimConfig(HW, 1, 2, policy="multi_turn", decode_max_batched_tokens=256))
    budgets = {inst.name: inst.max_batched_tokens for inst in sim.workers}
    assert budgets == {"http://sim-prefill-0": 8192, "http://sim-decode-0": 256,
                       "http://sim-decode-1": 256}
