"""perf.replay: an open-loop workload through pd-router to engine-model-timed mocks (pull flow),
and what the mocks tell of it (mock.client)."""

from __future__ import annotations

import asyncio

from pd_plugins.perf import report
from pd_plugins.perf.hardware import preset
from pd_plugins.mock.client import attach_engine_times, collect_engine_stats
from pd_plugins.perf.replay import replay
from pd_plugins.workloads import ConversationSpec, first_n, generate_conversations
from tests.router.conftest import deployment, mocks, wait_until

PRESET = "llama-3.1-8b@h100"
HW = preset(PRESET)
SPEEDUP = 20
MODELLED = ("--latency-model", PRESET, "--speedup", str(SPEEDUP), "--max-model-len", "16384")


def workload():
    """Ten single-turn chats, no shared system prompt: every prompt is new to every cache."""
    spec = ConversationSpec(session_rate_per_s=2.0, mean_turns=1, max_turns=1, user_tokens_median=1500,
                            user_tokens_range=(600, 4000), assistant_tokens_median=60,
                            assistant_tokens_range=(20, 150), shared_system_tokens=0)
    reqs = first_n(generate_conversations(spec, 10, seed=3), 10)
    assert len(reqs) == 10 and len({r.block_hashes[0] for r in reqs}) == 10
    return reqs


def test_replay_through_router_disaggregates_and_pulls_kv():
    reqs = workload()
    prefills, decodes = mocks(prefill_args=MODELLED, decode_args=MODELLED)
    with deployment(prefills, decodes) as router:
        done = []
        result = asyncio.run(replay(router.url, reqs, SPEEDUP, "mock", timeout_s=30, progress=done.append))
        wait_until(lambda: prefills[0].stats()["rooms_held"] == 0, timeout=5, what="every transfer read")
        stats = asyncio.run(collect_engine_stats([prefills[0].url, decodes[0].url]))
        matched = asyncio.run(attach_engine_times(result.outcomes, reqs, [prefills[0].url, decodes[0].url]))
    outcomes = result.outcomes
    assert matched == 10
    assert [o.status for o in outcomes] == ["ok"] * 10, [o.error for o in outcomes]
    # A mock that fell behind its clock runs a late request's steps from its own (earlier) model
    # time, so the engine times below may come out short by up to that lag.
    lag = sum(stats["engines"][e.url]["max_lag_s"] for e in (prefills[0], decodes[0]))
    assert done == list(range(1, 11))
    for o in outcomes:
        assert o.disaggregated, o.route
        assert o.tokens == o.output_tokens and len(o.itl_s) == o.output_tokens - 1
        # the prefill, then the pull of the whole prompt, then a decode step: all in model time
        first = HW.prefill_s(o.input_tokens) + HW.transfer_s(o.input_tokens)
        assert o.ttft_s > first, o
        # the engines' own share of it: the same prefill and pull, without HTTP and the router
        assert first - lag < o.engine_ttft_s < o.ttft_s, (o, lag)
        # ... and a decode step for every token (a step is never shorter than a lone request's;
        # a mock catching up on its clock runs steps early, by up to its lag)
        assert o.e2e_s > first + o.output_tokens * HW.decode_step_s(1, o.input_tokens) - lag, (o, lag)
    prompt_tokens = sum(r.input_tokens for r in reqs)
    prefill, decode = (stats["engines"][e.url] for e in (prefills[0], decodes[0]))
    assert prefill["prefill_tokens_computed"] == prompt_tokens and prefill["transfer_tokens"] == 0
    assert decode["transfer_tokens"] == prompt_tokens and decode["prefill_tokens_computed"] == 0
    assert stats["transfer_tokens"] == prompt_tokens
    assert stats["kv_bytes_moved"] == HW.kv_bytes(prompt_tokens)
    summary = report.summarize(outcomes, report.Slo(ttft_s=5.0, tpot_s=0.1), result.span_s,
                               itl_s=result.itl_s, cached_tokens=stats["cached_tokens"],
                               computed_tokens=stats["computed_tokens"],
                               kv_bytes_moved=stats["kv_bytes_moved"])
    assert summary["served"] == 10 and summary["local_prefill"] == 0
    assert summary["cache_hit_rate"] == 0.0 and summary["itl_s"]["mean"] > 0
    assert result.span_s >= max(r.arrival_s for r in reqs)
