"""The multi-turn conversation generator: determinism, prefix-sharing structure, distributions."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import pytest

from pd_plugins.workloads import (HASH_BLOCK_SIZE, ConversationSpec, generate_conversations,
                                  prompt_token_ids)

SPEC = ConversationSpec()


def by_session(reqs):
    sessions = defaultdict(list)
    for r in reqs:  # arrival order == turn order within a session
        sessions[r.session_id].append(r)
    return sessions


@pytest.fixture(scope="module")
def big():
    return generate_conversations(SPEC, 3000, seed=7)


def test_seeded_and_sorted():
    a = generate_conversations(SPEC, 50, seed=1)
    assert a == generate_conversations(SPEC, 50, seed=1)
    other = generate_conversations(SPEC, 50, seed=2)
    assert [r.input_tokens for r in other] != [r.input_tokens for r in a]
    assert not {h for r in a for h in r.block_hashes} & {h for r in other for h in r.block_hashes}
    assert [r.request_id for r in a] == list(range(len(a)))
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:]))
    assert {r.session_id for r in a} == {f"s{n}" for n in range(50)}


def test_turns_grow_and_chain_their_full_blocks(big):
    for turns in by_session(big).values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.input_tokens > prev.input_tokens + prev.output_tokens
            service_s = prev.output_tokens * SPEC.service_s_per_output_token
            assert nxt.arrival_s > prev.arrival_s + service_s
            full = prev.full_block_hashes()
            assert nxt.block_hashes[: len(full)] == full


def test_prompts_of_later_turns_extend_earlier_ones():
    turns = by_session(generate_conversations(SPEC, 5, seed=3))["s0"]
    prompts = [prompt_token_ids(r) for r in turns]
    for r, prompt, nxt in zip(turns, prompts, prompts[1:]):
        n = len(r.full_block_hashes()) * HASH_BLOCK_SIZE
        assert nxt[:n] == prompt[:n]


@pytest.mark.parametrize("system_tokens, shared", [(1024, 2), (1000, 1), (0, 0)])
def test_sessions_share_only_system_prompt_blocks(system_tokens, shared):
    spec = ConversationSpec(shared_system_tokens=system_tokens)
    sessions = by_session(generate_conversations(spec, 40, seed=5))
    system = sessions["s0"][0].block_hashes[:shared]  # full blocks entirely inside the prompt
    assert all(r.block_hashes[:shared] == system for rs in sessions.values() for r in rs)
    owners = defaultdict(set)  # full-block id -> sessions holding it
    for s, rs in sessions.items():
        for r in rs:
            for h in r.full_block_hashes():
                owners[h].add(s)
    assert {h for h, who in owners.items() if len(who) > 1} == set(system)


def test_each_turn_is_a_token_prefix_of_the_next(big):
    sessions = by_session(big)
    for turns in list(sessions.values())[:50]:
        for a, b in zip(turns, turns[1:]):
            ids_a, ids_b = prompt_token_ids(a), prompt_token_ids(b)
            assert ids_b[:len(ids_a)] == ids_a  # the client resends the whole conversation
            assert b.block_hashes[:len(a.block_hashes)] == a.block_hashes
    partial = {r.block_hashes[-1]: r.session_id for r in big if r.input_tokens % HASH_BLOCK_SIZE}
    assert len(partial) > 0.5 * len(big)
    owners = defaultdict(set)
    for r in big:
        for h in r.block_hashes:
            owners[h].add(r.session_id)
    assert all(owners[h] == {s} for h, s in partial.items())  # a session's own block
    assert all(len(r.block_hashes) == math.ceil(r.input_tokens / HASH_BLOCK_SIZE) for r in big)
    assert min(h for r in big for h in r.block_hashes) >= 1 << 63  # clear of Mooncake and Azure


def test_distributions_match_the_spec(big):
    sessions = by_session(big)
    n_turns = [len(t) for t in sessions.values()]
    assert abs(statistics.mean(n_turns) - SPEC.mean_turns) < 0.25 and max(n_turns) <= SPEC.max_turns
    users, thinks = [], []
    for turns in sessions.values():
        users.append(turns[0].input_tokens - SPEC.shared_system_tokens)
        for prev, nxt in zip(turns, turns[1:]):
            users.append(nxt.input_tokens - prev.input_tokens - prev.output_tokens)
            thinks.append(nxt.arrival_s - prev.arrival_s
                          - prev.output_tokens * SPEC.service_s_per_output_token)
    assert statistics.median(users) == pytest.approx(SPEC.user_tokens_median, rel=0.1)
    assert statistics.median(r.output_tokens for r in big) == pytest.approx(
        SPEC.assistant_tokens_median, rel=0.1)
    assert statistics.median(thinks) == pytest.approx(SPEC.think_time_median_s, rel=0.1)
    lo, hi = SPEC.user_tokens_range
    assert lo <= min(users) and max(users) <= hi
    starts = [t[0].arrival_s for t in sessions.values()]
    assert len(starts) / max(starts) == pytest.approx(SPEC.session_rate_per_s, rel=0.1)


def test_spec_validation():
    with pytest.raises(ValueError):
        ConversationSpec(session_rate_per_s=0)
    with pytest.raises(ValueError):
        ConversationSpec(user_tokens_range=(10, 5))
    one = generate_conversations(ConversationSpec(mean_turns=1), 20, seed=0)
    assert len(one) == 20 and {r.turn for r in one} == {0}


def test_finer_blocks_keep_the_prefix_structure():
    """block_tokens=16 (an engine's block): one id per 16 tokens, turns still chain, prompts still
    extend each other token for token, and the system prompt's blocks are shared."""
    spec = ConversationSpec(block_tokens=16, shared_system_tokens=1000)
    sessions = by_session(generate_conversations(spec, 20, seed=5))
    for turns in sessions.values():
        for r in turns:
            assert r.block_tokens == 16 and len(r.block_hashes) == math.ceil(r.input_tokens / 16)
        for a, b in zip(turns, turns[1:]):
            assert prompt_token_ids(b)[:a.input_tokens] == prompt_token_ids(a)
            assert b.block_hashes[:len(a.full_block_hashes())] == a.full_block_hashes()
    firsts = [turns[0] for turns in sessions.values()]
    assert len({r.block_hashes[:1000 // 16] for r in firsts}) == 1  # 62 shared full blocks
    assert len({r.block_hashes[1000 // 16] for r in firsts}) == len(firsts)  # then each its own
    with pytest.raises(ValueError):
        ConversationSpec(block_tokens=0)
