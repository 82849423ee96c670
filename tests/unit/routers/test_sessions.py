"""Conversations: ids from the request, automatic detection, table bounds and expiry, pinning and
re-pinning, and the append-prefill decider's choices."""

from __future__ import annotations

import pytest

from pd_plugins.routers.config import SessionSpec
from pd_plugins.routers.http_server import RequestHeaders, header_map
from pd_plugins.routers.policy.base import RequestInfo, build
from pd_plugins.vocab.block_keys import block_keys
from pd_plugins.routers.policy.scheduler import Scheduler, preset
from pd_plugins.routers.request import BadRequest, parse_request
from pd_plugins.routers.sessions import SessionTable
from tests.unit.routers.helpers import BLOCK, Target, context, serving

HISTORY = list(range(100, 140))                  # turn 1's prompt: 10 blocks of 4 tokens
TURN2 = HISTORY + list(range(500, 506))          # turn 2 appends 6 tokens


def info(tokens, session_id=None) -> RequestInfo:
    return RequestInfo(prompt_tokens=len(tokens), block_keys=block_keys(tokens, BLOCK), session_id=session_id)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- ids from the request ------------------------------------------------------------------------
def parse(body: dict, headers: dict | None = None):
    import msgspec
    return parse_request(msgspec.json.encode(body), "completion", headers or {},
                         strip_transfer_fields=False,
                         select_model=serving(Target(max_model_len=None, key_block_size=BLOCK)))


def front(headers: dict) -> RequestHeaders:
    """Headers as the front server hands them over (its fast path: no session header at all)."""
    return RequestHeaders(header_map({k.encode(): v.encode() for k, v in headers.items()}))


def test_session_id_from_the_front_servers_headers():
    assert parse({"prompt": "hi"}, front({"X-Conversation-Id": " c9"})).info.session_id == "c9"
    assert parse({"prompt": "hi"}, front({"X-User-Id": "u1", "Accept": "*/*"})).info.session_id == "u1"
    assert parse({"prompt": "hi", "user": "bob"}, front({"Accept": "*/*"})).info.session_id == "bob"
    assert parse({"prompt": "hi"}, front({"Accept": "*/*"})).info.session_id is None


def test_session_id_from_header_then_body_fields_trimmed():
    assert parse({"prompt": "hi"}, {"x-session-id": "  conv-7 "}).info.session_id == "conv-7"
    assert parse({"prompt": "hi", "session_id": "s1", "user": "u"}).info.session_id == "s1"
    assert parse({"prompt": "hi", "user": "alice"}).info.session_id == "alice"
    assert parse({"prompt": "hi", "user": "   "}).info.session_id is None
    assert parse({"prompt": "hi"}).info.session_id is None


@pytest.mark.parametrize("body, headers, param", [
    ({"prompt": "hi", "session_id": "x" * 129}, None, "session_id"),
    ({"prompt": "hi", "session_id": 5}, None, "session_id"),
    ({"prompt": "hi", "user": "caf\u00e9"}, None, "user"),
    ({"prompt": "hi"}, {"x-session-id": "a\tb"}, "x-session-id"),
])
def test_malformed_session_ids_are_refused_with_a_reason(body, headers, param):
    with pytest.raises(BadRequest) as err:
        parse(body, headers)
    assert err.value.status == 400 and err.value.param == param and "session id" in err.value.message \
        or "must be a string" in err.value.message


# -- the table ------------------------------------------------------------------------------------
def test_pin_resolve_and_repin():
    table = SessionTable(SessionSpec())
    first = info(HISTORY, "c1")
    table.resolve(first)
    assert first.turn == 0 and first.pinned_decode is None
    assert table.record(first, "http://d0") == "c1"
    second = info(TURN2, "c1")
    table.resolve(second)
    assert (second.turn, second.pinned_decode, second.resident_tokens) == (1, "http://d0", 40)
    table.record(second, "http://d1")  # served elsewhere (its pin was down): re-pinned there
    third = info(TURN2 + [1, 2, 3, 4], "c1")
    table.resolve(third)
    assert third.pinned_decode == "http://d1" and third.turn == 2
    assert table.counts["pinned"] == 1 and table.counts["repinned"] == 1
    assert table.forget_worker("http://d1") == 1
    fourth = info(TURN2, "c1")
    table.resolve(fourth)
    assert fourth.pinned_decode is None and fourth.turn == 2


def test_automatic_detection_by_prefix_chain():
    table = SessionTable(SessionSpec())
    first = info(HISTORY)
    table.resolve(first)
    assert first.session_id is None
    session = table.record(first, "http://d0")
    assert session.startswith("auto-")
    later = info(TURN2)  # extends turn 1's prompt: the same conversation
    table.resolve(later)
    assert later.session_id == session and later.pinned_decode == "http://d0"
    stranger = info(list(range(900, 940)))
    table.resolve(stranger)
    assert stranger.session_id is None and table.counts["detected"] == 1
    off = SessionTable(SessionSpec(detect=False))
    off.record(info(HISTORY), "http://d0")
    probe = info(TURN2)
    off.resolve(probe)
    assert probe.session_id is None and len(off) == 0


def test_table_is_bounded_by_lru_and_ttl():
    clock = Clock()
    table = SessionTable(SessionSpec(max_sessions=3, ttl_s=10), clock)
    for i in range(5):
        clock.now = i
        table.record(info(HISTORY, f"s{i}"), "http://d0")
    assert len(table) == 3 and table.get("s0") is None and table.get("s1") is None
    assert table.counts["evicted"] == 2
    clock.now = 13.5  # s2 (used at 2) and s3 (at 3) have been idle 10 s or more; s4 (at 4) has not
    table.resolve(info(HISTORY, "s4"))
    assert table.get("s2") is None and table.get("s3") is None and table.get("s4") is not None
    assert table.counts["expired"] == 2


def test_a_million_sessions_stay_bounded():
    table = SessionTable(SessionSpec(max_sessions=1000))
    for i in range(1_000_000 // 50):  # keys are shared: 20k distinct sessions, quickly
        table.record(RequestInfo(prompt_tokens=4, block_keys=[i], session_id=f"s{i}"), "http://d0")
    assert len(table) == 1000 and len(table._chains) <= 4000


# -- the policy pieces ----------------------------------------------------------------------------
def test_session_pin_keeps_the_pinned_worker_while_it_holds_the_history():
    ctx = context(decodes=3)
    pin = build("filter", "session_pin", {}, ctx)
    d0, d1, d2 = ctx.pool.by_role("decode")
    req = info(TURN2, "c1")
    assert pin.filter(req, [d0, d1, d2]) == [d0, d1, d2]  # turn 1: no pin
    req.pinned_decode, req.resident_tokens, req.turn = d1.url, 40, 1
    ctx.prefix_index.record_routed(d1.url, block_keys(HISTORY, BLOCK))
    assert pin.filter(req, [d0, d1, d2]) == [d1]
    assert pin.filter(req, [d0, d2]) == [d0, d2]  # pinned worker unusable: anywhere, re-pin
    ctx.prefix_index.forget_worker(d1.url)
    ctx.prefix_index.record_routed(d1.url, block_keys(HISTORY[:16], BLOCK))  # 4 of 10 blocks left
    assert pin.filter(req, [d0, d1, d2]) == [d0, d1, d2]  # history evicted: no reason to stay


def test_append_prefill_decider():
    ctx = context(prefill_base_s=0.01, prefill_per_token_s=0.001, decode_step_base_s=0.01,
                  decode_step_per_request_s=0.001)
    d0 = ctx.pool.by_role("decode")[0]
    prefills = ctx.pool.by_role("prefill")
    decider = build("decider", "append_prefill", {"max_append_tokens": 16}, ctx)
    ctx.prefix_index.record_routed(d0.url, block_keys(HISTORY, BLOCK))
    turn1 = info(HISTORY, "c1")
    assert decider.disaggregate(turn1, d0, prefills)[0] is True  # turn 1 always goes through PD
    turn2 = info(TURN2, "c1")
    turn2.turn, turn2.pinned_decode = 1, d0.url
    go, why = decider.disaggregate(turn2, d0, prefills)  # 6 uncached tokens < 16
    assert go is False and "append-prefill: 6 new tokens" in why
    other = ctx.pool.by_role("decode")[1]
    assert decider.disaggregate(turn2, other, prefills)[0] is True  # not its pinned worker
    # Long append: the TTFT gain (no queue, no transfer) against the stall of the running decodes.
    long = info(HISTORY + list(range(2000, 2200)), "c1")
    long.turn, long.pinned_decode = 1, d0.url
    for w in prefills:
        w.in_flight, w.in_flight_prefill_tokens = 4, 4000  # prefill pool busy: local wins
    go, why = decider.disaggregate(long, d0, prefills)
    assert go is False and why.startswith("append-prefill: TTFT gain")
    for w in prefills:
        w.in_flight, w.in_flight_prefill_tokens = 0, 0
    # An idle prefill pool and a busy decode worker: a 3000-token prefill there would stall 40
    # running decodes for ~3 s each; it saves the transfer only.
    huge = info(HISTORY + list(range(3000, 6000)), "c1")
    huge.turn, huge.pinned_decode = 1, d0.url
    d0.in_flight = 40
    go, why = decider.disaggregate(huge, d0, prefills)
    assert go is True and "full PD" in why
    d0.in_flight = 0  # nobody to stall: the gain decides
    assert decider.disaggregate(huge, d0, prefills)[0] is False
    # The 200-token append again, prefill pool busy (TTFT gain over 4 s): its 0.21 s prefill stalls
    # 10 decodes (2.1 s of waiting), which the default weight 0.1 accepts and weight 3 does not.
    for w in prefills:
        w.in_flight, w.in_flight_prefill_tokens = 4, 4000
    d0.in_flight = 10
    assert decider.disaggregate(long, d0, prefills)[0] is False
    strict = build("decider", "append_prefill", {"max_append_tokens": 16, "w_tpot": 3.0}, ctx)
    go, why = strict.disaggregate(long, d0, prefills)
    assert go is True and why.startswith("full PD: TTFT gain")


def test_multi_turn_preset_routes_turn_two_to_its_pinned_worker_without_a_prefill_leg():
    ctx = context(decodes=3)
    scheduler = Scheduler(preset("multi_turn"), ctx)
    assert scheduler.uses_sessions
    table = SessionTable(SessionSpec())
    first = info(HISTORY, "c1")
    table.resolve(first)
    d1 = scheduler.schedule(first)
    assert d1.prefill is not None
    table.record(first, d1.decode.url)
    ctx.prefix_index.record_routed(d1.decode.url, first.block_keys)
    for w in ctx.pool.by_role("decode"):
        w.in_flight = 0 if w is not d1.decode else 3  # least_loaded alone would go elsewhere
    second = info(TURN2, "c1")
    table.resolve(second)
    d2 = scheduler.schedule(second)
    assert d2.decode is d1.decode and d2.prefill is None
    assert any("append-prefill" in r for r in d2.reasons)


def test_a_client_cannot_name_an_automatic_session():
    """Automatic ids are unguessable: a client that sends `auto-1` (ids were sequential) neither
    takes over the first detected conversation's pin nor absorbs the next one."""
    table = SessionTable(SessionSpec())
    victim = parse({"prompt": HISTORY})
    table.resolve(victim.info)
    auto = table.record(victim.info, "http://d0")
    assert auto.startswith("auto-") and auto not in {f"auto-{n}" for n in range(1, 1000)}
    attacker = parse({"prompt": [1]}, {"x-session-id": "auto-1"})
    table.resolve(attacker.info)
    assert attacker.info.pinned_decode is None  # not the victim's
    table.record(attacker.info, "http://d1")
    later = parse({"prompt": TURN2})
    table.resolve(later.info)
    assert (later.info.session_id, later.info.pinned_decode) == (auto, "http://d0")
    stranger = parse({"prompt": list(range(700, 740))})  # the router's next automatic session
    table.resolve(stranger.info)
    assert table.record(stranger.info, "http://d2") not in (auto, "auto-1")
    assert SessionTable(SessionSpec()).record(parse({"prompt": HISTORY}).info, "x") != auto


def test_a_shared_full_block_prefix_with_another_tail_is_not_a_next_turn():
    """A short request made of a system prompt and a few tokens chains at a block of the system
    prompt: later requests sharing that system prompt are not its next turns (their prompts do
    not extend its tail), while a real next turn is found."""
    system = list(range(100, 140))  # 10 full blocks
    table = SessionTable(SessionSpec())
    short = parse({"prompt": system + [7, 8]})
    table.resolve(short.info)
    session = table.record(short.info, "http://d0")
    for n in range(5):  # other users' requests with the same system prompt
        other = parse({"prompt": system + [300 + n, 400 + n, 5, 6, 7]})
        table.resolve(other.info)
        assert other.info.session_id is None and other.info.pinned_decode is None
    turn2 = parse({"prompt": system + [7, 8, 9, 10, 11, 12]})
    table.resolve(turn2.info)
    assert (turn2.info.session_id, turn2.info.turn) == (session, 1)
    # text prompts estimated from characters are checked the same way
    text = SessionTable(SessionSpec())
    first = parse({"prompt": "s" * 160 + "ab"})
    text.resolve(first.info)
    text_session = text.record(first.info, "http://d0")
    stranger, follow = parse({"prompt": "s" * 160 + "xy" * 9}), parse({"prompt": "s" * 160 + "abz"})
    text.resolve(stranger.info)
    text.resolve(follow.info)
    assert stranger.info.session_id is None and follow.info.session_id == text_session
