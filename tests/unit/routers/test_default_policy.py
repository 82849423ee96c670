"""pd-router's default policy (`default`): `goodput` on single-turn traffic, `multi_turn` on a
conversation's later turns, and the default of both the CLI and a YAML file without `policy:`."""

from __future__ import annotations

import pytest

from pd_plugins.routers.cli import build_parser, config_from_args
from pd_plugins.routers.config import SessionSpec
from pd_plugins.routers.policy import DEFAULT_POLICY, preset
from pd_plugins.routers.policy.base import build
from pd_plugins.routers.policy.scheduler import Scheduler
from pd_plugins.routers.sessions import SessionTable
from tests.unit.routers.helpers import context, learn_priors, request

HISTORY = list(range(100, 140))  # turn 1: 40 tokens, 10 blocks of 4


def test_default_is_the_default_preset_of_cli_and_yaml(tmp_path):
    assert DEFAULT_POLICY == "default"
    cli = config_from_args(build_parser().parse_args(["--decode", "http://127.0.0.1:8200"]))
    assert cli.policy == preset("default")
    path = tmp_path / "router.yaml"
    path.write_text('decode: [{url: "http://127.0.0.1:8200"}]\n')
    yaml = config_from_args(build_parser().parse_args(["--config", str(path)]))
    assert yaml.policy == preset("default")
    assert build_parser()._option_string_actions["--policy"].help.endswith("(default default)")
    scheduler = Scheduler(preset("default"), context())
    assert scheduler.uses_sessions and scheduler.uses_prefix_index


def _state(ctx, case: str) -> None:
    prefills, decodes = ctx.pool.by_role("prefill"), ctx.pool.by_role("decode")
    if case == "prefill pool saturated":  # prefill_load converts a decode worker
        for w in prefills:
            w.in_flight, w.in_flight_prefill_tokens = 6, 60_000
    elif case == "decode saturated":
        decodes[0].engine_waiting = 100
    elif case == "decode kv full":
        decodes[0].kv_usage, decodes[1].kv_usage = 0.95, 0.5
        for w in prefills:
            w.in_flight, w.in_flight_prefill_tokens = 6, 60_000


@pytest.mark.parametrize("case", ["idle", "prefill pool saturated", "decode saturated", "decode kv full"])
@pytest.mark.parametrize("tokens", [40, 900, 3000])
def test_single_turn_requests_are_routed_as_goodput_routes_them(case, tokens):
    decisions = {}
    for name in ("goodput", "default"):
        ctx = context(prefill_base_s=0.01, prefill_per_token_s=0.0005)
        _state(ctx, case)
        scheduler, table = Scheduler(preset(name), ctx), SessionTable(SessionSpec())
        out = []
        for i in range(4):  # distinct prompts: no conversation to detect
            req = request([10_000 * (i + 1) + t for t in range(tokens)])
            table.resolve(req)
            assert req.turn == 0 and req.pinned_decode is None
            d = scheduler.schedule(req)
            table.record(req, d.decode.url)
            out.append((d.decode.url, d.prefill.url if d.prefill else None, d.reasons))
        decisions[name] = out
    assert decisions["default"] == decisions["goodput"]
    if tokens == 40:  # goodput's short-prompt rule: prefilled on the decode worker
        assert all(prefill is None for _, prefill, _ in decisions["default"])


def _conversation(name: str, append_tokens: int, pinned_load: int, **latency):
    """Turn 1, then turn 2 (`append_tokens` new tokens) with the pinned decode worker running
    `pinned_load` requests and the other one idle: turn 2's decision under preset `name`."""
    ctx = context(prefill_base_s=0.01, prefill_per_token_s=0.001, **latency)
    scheduler, table = Scheduler(preset(name), ctx), SessionTable(SessionSpec())
    first = request(HISTORY, session_id="c1")
    table.resolve(first)
    d1 = scheduler.schedule(first)
    table.record(first, d1.decode.url)
    ctx.prefix_index.record_routed(d1.decode.url, first.block_keys)
    for w in ctx.pool.by_role("decode"):
        w.in_flight = pinned_load if w is d1.decode else 0  # least_loaded alone would move it
    second = request(HISTORY + list(range(5000, 5000 + append_tokens)), session_id="c1")
    table.resolve(second)
    assert second.turn == 1 and second.pinned_decode == d1.decode.url
    return d1, scheduler.schedule(second)


def test_a_later_turn_is_pinned_and_appended_as_under_multi_turn():
    for name in ("multi_turn", "default"):
        d1, d2 = _conversation(name, append_tokens=8, pinned_load=3)
        assert d2.decode is d1.decode and d2.prefill is None, name
        assert any("append-prefill: 8 new tokens" in r for r in d2.reasons), name


def test_append_prefill_alone_decides_a_pinned_turn():
    # 700 new tokens on a pinned worker running 40 decodes, prefill pool idle: append_prefill
    # weighs the stall and sends the turn through PD; goodput's uncached_length (local under 1024
    # tokens) would keep it on the decode worker, and does, without skip_pinned_turns.
    outcomes = {}
    for name in ("multi_turn", "default"):
        d1, d2 = _conversation(name, append_tokens=700, pinned_load=40)
        assert d2.decode is d1.decode, name
        outcomes[name] = (d2.prefill is None, [r.split(":")[0] for r in d2.reasons])
    assert outcomes["default"] == outcomes["multi_turn"] == (False, ["decode", "prefill"])


def test_a_conversation_leaves_a_saturated_pinned_worker():
    """The one planned difference from multi_turn: saturation is filtered before the pin."""
    for name, stays in (("multi_turn", True), ("default", False)):
        ctx = context(decodes=2)
        scheduler, table = Scheduler(preset(name), ctx), SessionTable(SessionSpec())
        first = request(HISTORY, session_id="c1")
        table.resolve(first)
        pinned = scheduler.schedule(first).decode
        table.record(first, pinned.url)
        ctx.prefix_index.record_routed(pinned.url, first.block_keys)
        pinned.engine_waiting = 100  # over not_saturated's max_waiting
        second = request(HISTORY + [7, 8], session_id="c1")
        table.resolve(second)
        assert (scheduler.schedule(second).decode is pinned) is stays, name


@pytest.mark.parametrize("decider, params", [
    ("uncached_length", {"min_uncached_tokens": 1024}),
    ("prefill_load", {"min_prefill_queue": 0, "margin": 0.0}),
])
def test_skip_pinned_turns_leaves_a_pinned_turn_to_append_prefill(decider, params):
    ctx = context(prefill_base_s=0.01, prefill_per_token_s=0.001)
    d0, d1 = ctx.pool.by_role("decode")
    prefills = ctx.pool.by_role("prefill")
    turn = request(HISTORY + [1, 2, 3, 4], session_id="c1", turn=1, pinned_decode=d0.url)
    plain = build("decider", decider, params, ctx)
    skipping = build("decider", decider, {**params, "skip_pinned_turns": True}, ctx)
    assert plain.disaggregate(turn, d0, prefills)[0] is False  # short, or convertible: local
    go, why = skipping.disaggregate(turn, d0, prefills)
    assert go is True and "append_prefill" in why
    # elsewhere than its pinned worker, or a first turn: the decider's own rule again
    assert skipping.disaggregate(turn, d1, prefills) == plain.disaggregate(turn, d1, prefills)
    first = request(HISTORY, session_id="c1")
    assert skipping.disaggregate(first, d0, prefills) == plain.disaggregate(first, d0, prefills)


def test_legs_of_one_length_do_not_lock_longer_prompts_out():
    """8 prefill legs of ~1000 tokens taking 60-80 ms: the fit with its negative intercept clamped
    predicted 6.3 s for 500 tokens, so everything over ~120 tokens was refused, and what was
    admitted was prefilled locally, which gives the fit no sample to recover from."""
    ctx = context()  # the shipped latency priors
    scheduler = Scheduler(preset("default"), ctx)
    for x, jitter in [(1000, -0.01), (1000, 0.0), (1000, -0.01), (1001, 0.01), (1000, 0.0),
                      (1001, 0.01), (1000, -0.01), (1001, 0.0)]:
        ctx.latency.prefill.observe(x, 0.02 + 5e-5 * x + jitter)
    for tokens in (500, 1000, 4000):
        assert scheduler.admit(request(list(range(tokens)))) is None, tokens


def _busy_prefill_pool():
    ctx = learn_priors(context(prefills=1, decodes=2))  # the shipped: 20 ms + 0.2 ms per token
    p = ctx.pool.by_role("prefill")[0]
    p.in_flight, p.in_flight_prefill_tokens = 8, 20_000  # ~4.2 s of queued prefills
    for d in ctx.pool.by_role("decode"):  # too full for prefill_load to convert them
        d.kv_usage = 0.75
    return ctx


@pytest.mark.parametrize("name", ["default", "goodput"])
def test_admission_judges_a_local_prefill_on_its_decode_worker(name):
    """A 200-token prompt the deciders prefill on an idle decode worker (~60 ms) was refused on
    the busy prefill pool's 4.2 s queue, which it never joins."""
    ctx = _busy_prefill_pool()
    scheduler = Scheduler(preset(name), ctx)
    short = request(list(range(100, 300)))
    assert scheduler.admit(short) is None  # no decision given: the scheduler's own
    decision = scheduler.schedule(short)
    assert decision.prefill is None and "uncached_length" in decision.reasons[-1]
    assert scheduler.admit(short, decision) is None
    # a prompt the deciders disaggregate is still judged on the prefill pool
    long = request(list(range(2000)))
    assert scheduler.schedule(long).prefill is not None
    assert scheduler.admit(long).retry_after_s == 4.0
    # and a local prefill behind the decode worker's own local prefills
    for d in ctx.pool.by_role("decode"):
        d.in_flight_prefill_tokens = 10_000  # 2 s of them
    rejection = scheduler.admit(short)
    assert rejection.status == 429 and "prefilled on its decode worker" in rejection.message


def test_the_proxy_admits_on_the_route_its_first_attempt_takes():
    import asyncio
    import itertools
    import types
    from unittest.mock import MagicMock

    from aiohttp import web

    from pd_plugins.routers.config import FailoverSpec
    from pd_plugins.routers.proxy import Proxy

    ctx = _busy_prefill_pool()
    taken = []

    async def run(http, attempt, started, history):
        taken.append(attempt.decision)
        return web.Response(status=200)

    proxy = Proxy.__new__(Proxy)  # _serve() reads only these
    proxy.sessions, proxy.scheduler, proxy.ctx = None, Scheduler(preset("default"), ctx), ctx
    proxy.metrics, proxy.config = MagicMock(), types.SimpleNamespace(failover=FailoverSpec())
    proxy._id_prefix, proxy._ids, proxy._run = "t", itertools.count(), run
    http = types.SimpleNamespace(get=lambda key, default=None: default, headers={})

    def serve(tokens):
        client = types.SimpleNamespace(info=request(tokens), fan_out=False, client_id=None)
        return asyncio.run(proxy._serve(http, client, "/v1/completions"))

    assert serve(list(range(100, 300))).status == 200
    assert len(taken) == 1 and taken[0].prefill is None
    refused = serve(list(range(2000)))
    assert refused.status == 429 and len(taken) == 1
    proxy.metrics.rejections.labels.assert_called_with("slo")
    assert refused.headers["Retry-After"] == "4"  # 4.6 s behind the queue, 0.42 s alone
    hopeless = serve(list(range(10_000)))  # 2.0 s alone: no wait helps
    assert hopeless.status == 429 and "Retry-After" not in hopeless.headers and len(taken) == 1
