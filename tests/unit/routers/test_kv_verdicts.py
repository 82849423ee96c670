"""The router's side of verified KV hand-off (issue 28, docs/plans/kv-verification.md §5): the
decode's `pd.kv` verdict read from a whole answer (header, metric, traffic record) and the
quarantine of a decode whose mismatch counter keeps rising (fake clock; the probe check against a
real loopback server)."""

import asyncio

import msgspec
import pytest
from aiohttp import web

from pd_plugins.routers.config import (ConfigError, HealthSpec, KvVerifySpec, RouterConfig,
                                       TrafficRecordSpec, WorkerSpec, config_from_mapping)
from pd_plugins.routers.health import PoolUpkeep, parse_counter
from pd_plugins.routers.kv_quarantine import KvQuarantine
from pd_plugins.routers.metrics import RouterMetrics
from pd_plugins.routers.policy import Decision
from pd_plugins.routers.policy.base import RequestInfo
from pd_plugins.routers.proxy import Proxy
from pd_plugins.routers.traffic_record import Measured, TrafficRecorder
from pd_plugins.routers.upstream import new_session
from pd_plugins.routers.workers import WorkerPool
from pd_plugins.vocab.transfer_params import (KV_MISMATCHED_REQUESTS_METRIC, KvVerdict,
                                              kv_verdict_in_answer)
from tests.unit.routers.helpers import loopback_server


def answer(params) -> bytes:
    return msgspec.json.encode({"id": "x", "choices": [{"text": "hi"}], "usage": {"completion_tokens": 1},
                                "kv_transfer_params": params})


VERDICT = KvVerdict(verdict="recomputed", blocks=4, mismatched=1, transport="pull")


# -- reading the verdict -------------------------------------------------------------------------
def test_the_verdict_is_read_from_a_whole_answer_and_nothing_else_is_needed():
    params = VERDICT.into({"pd": {"engine_id": "e", "other": [1, 2]}, "remote_host": "h"})
    assert kv_verdict_in_answer(answer(params)) == VERDICT


@pytest.mark.parametrize("payload", [
    b'{"choices": []}',                                   # no kv_transfer_params at all
    answer(None), answer({}), answer({"pd": None}), answer({"pd": {"engine_id": "e"}}),
    b'{"kv_transfer_params": ',                           # not JSON: not ours to judge
])
def test_no_verdict(payload):
    assert kv_verdict_in_answer(payload) is None


@pytest.mark.parametrize("params", [
    {"pd": {"kv": {"verdict": "fine", "blocks": 1, "mismatched": 0, "transport": "pull"}}},
    {"pd": {"kv": {"verdict": "verified"}}},              # fields missing
    {"pd": {"kv": "verified"}},
    {"pd": "kv"},
    "params",
])
def test_a_malformed_section_is_a_value_error(params):
    with pytest.raises(ValueError):
        kv_verdict_in_answer(answer(params))


def bare_proxy(route_header: str = "full") -> Proxy:
    """A Proxy with just what the verdict and the header read (no pools, no scheduler)."""
    proxy = Proxy.__new__(Proxy)
    proxy.config = RouterConfig(decode=[WorkerSpec(url="http://d")], route_header=route_header)
    proxy._model_tag, proxy.sessions = "", None
    proxy.metrics, proxy.kv_quarantine = RouterMetrics(WorkerPool()), None
    return proxy


def decision() -> Decision:
    pool = WorkerPool()
    p = pool.add(WorkerSpec(url="http://p0"), "prefill")
    d = pool.add(WorkerSpec(url="http://d0"), "decode")
    return Decision(prefill=p, decode=d, reasons=["prefix_cache: x, y"])


def sample(proxy: Proxy, verdict: str) -> float | None:
    return proxy.metrics.registry.get_sample_value("pd_router_kv_verdicts_total",
                                                   {"verdict": verdict})


def test_verdicts_are_counted_malformed_ones_as_other_absent_ones_not_at_all():
    proxy = bare_proxy()
    assert proxy._kv_verdict(answer(VERDICT.into(None))) == "recomputed"
    assert proxy._kv_verdict(answer({"pd": {"kv": {"verdict": "<script>"}}})) == "other"
    assert proxy._kv_verdict(answer(None)) is None
    assert proxy._kv_verdict(b'{"choices": []}') is None
    assert (sample(proxy, "recomputed"), sample(proxy, "other")) == (1.0, 1.0)
    assert sample(proxy, "verified") is None


def test_the_full_route_header_carries_the_verdict_the_minimal_one_does_not():
    full, info = bare_proxy(), RequestInfo(prompt_tokens=10, block_keys=[])
    header = full._route_header(decision(), [], info, "recomputed")
    assert header == "prefill=http://p0, decode=http://d0, kv=recomputed, why=prefix_cache: x, y"
    assert "kv=" not in full._route_header(decision(), [], info, None)
    minimal = bare_proxy("minimal")
    assert minimal._route_header(decision(), [], info, "recomputed") == "route=disaggregated"


def test_the_traffic_record_has_the_verdict_when_there_is_one(tmp_path):
    rec = TrafficRecorder(TrafficRecordSpec(path=str(tmp_path / "r.jsonl")))
    with_kv, without = Measured(1.0), Measured(2.0)
    with_kv.kv = "verified"
    request = RequestInfo(prompt_tokens=3, block_keys=[])
    lines = [msgspec.json.decode(rec._line("m", request, 16, m, 200, None))
             for m in (with_kv, without)]
    assert lines[0]["kv"] == "verified" and "kv" not in lines[1]


# -- config ------------------------------------------------------------------------------------------
def test_kv_verify_config_is_typed_strict_and_can_be_switched_off():
    base = {"decode": [{"url": "http://d"}]}
    assert config_from_mapping(base).health.kv_verify == KvVerifySpec(failures=3, window_s=60,
                                                                      quarantine_s=300)
    spec = config_from_mapping({**base, "health": {"kv_verify": {"failures": 5, "window_s": 10,
                                                                 "quarantine_s": 30}}})
    assert spec.health.kv_verify == KvVerifySpec(failures=5, window_s=10, quarantine_s=30)
    assert config_from_mapping({**base, "health": {"kv_verify": None}}).health.kv_verify is None
    for bad in ({"failures": 3, "windows": 60}, {"failures": 0}, {"window_s": 0},
                {"quarantine_s": -1}, {"failures": "many"}):
        with pytest.raises(ConfigError):
            config_from_mapping({**base, "health": {"kv_verify": bad}}).validate()


# -- the quarantine rule (fake clock) ------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def two_decodes():
    pool = WorkerPool()
    d0 = pool.add(WorkerSpec(url="http://d0"), "decode")
    d1 = pool.add(WorkerSpec(url="http://d1"), "decode")
    pool.add(WorkerSpec(url="http://p0"), "prefill")
    return pool, d0, d1


def test_mismatches_reaching_failures_within_the_window_quarantine_the_decode():
    clock, (pool, d0, d1) = Clock(), two_decodes()
    kv = KvQuarantine(KvVerifySpec(failures=3, window_s=60, quarantine_s=300), clock)
    assert not kv.observe(d0, 7.0, pool)  # first look: a baseline, old mismatches not counted
    clock.now += 10
    assert not kv.observe(d0, 9.0, pool)  # +2
    clock.now += 10
    assert kv.observe(d0, 10.0, pool)     # +1: 3 within 60 s
    assert not d0.healthy and d1.healthy and d0.quarantined_until == clock.now + 300
    assert kv.quarantined(d0)
    clock.now += 300.1
    assert not kv.quarantined(d0)


def test_mismatches_spread_wider_than_the_window_do_not():
    clock, (pool, d0, _) = Clock(), two_decodes()
    kv = KvQuarantine(KvVerifySpec(failures=3, window_s=60, quarantine_s=300), clock)
    kv.observe(d0, 0.0, pool)
    for value in (1.0, 2.0, 3.0, 4.0):
        clock.now += 40  # one mismatch every 40 s: never 3 within 60 s
        assert not kv.observe(d0, value, pool)
    assert d0.healthy


def test_a_rise_over_a_gap_longer_than_the_window_is_a_new_baseline():
    clock, (pool, d0, _) = Clock(), two_decodes()
    kv = KvQuarantine(KvVerifySpec(failures=3, window_s=60, quarantine_s=300), clock)
    kv.observe(d0, 0.0, pool)
    clock.now += 120  # not scraped meanwhile (down, or quarantined): when did these happen?
    assert not kv.observe(d0, 50.0, pool) and d0.healthy
    clock.now += 1
    assert kv.observe(d0, 53.0, pool)


def test_an_engine_restart_counts_its_new_value_not_a_negative_rise():
    clock, (pool, d0, _) = Clock(), two_decodes()
    kv = KvQuarantine(KvVerifySpec(failures=3, window_s=60, quarantine_s=300), clock)
    kv.observe(d0, 50.0, pool)
    assert not kv.observe(d0, 2.0, pool)  # restarted: 2 new mismatches
    assert kv.observe(d0, 3.0, pool)


def test_never_the_last_usable_decode_and_never_a_prefill():
    clock, (pool, d0, d1) = Clock(), two_decodes()
    kv = KvQuarantine(KvVerifySpec(failures=1, window_s=60, quarantine_s=300), clock)
    d1.healthy = False  # the other decode is down: d0 is the last one
    kv.observe(d0, 0.0, pool)
    assert not kv.observe(d0, 5.0, pool) and d0.healthy
    d1.healthy = True  # back: the mismatches still in the window now take d0 out
    assert kv.observe(d0, 5.0, pool) and not d0.healthy
    # d1 is now the last usable decode: spared however many mismatches it has
    kv.observe(d1, 0.0, pool)
    assert not kv.observe(d1, 100.0, pool) and d1.healthy
    prefill = pool.get("http://p0", "prefill")
    assert not kv.observe(prefill, 0.0, pool) and not kv.observe(prefill, 100.0, pool)
    assert kv.counts == {"quarantined_decode": 1, "quarantined_prefill": 0, "spared": 2}


def test_counter_parse_sums_label_sets_and_tells_absent_from_zero():
    name = KV_MISMATCHED_REQUESTS_METRIC
    text = (f"# HELP {name} x\n{name}{{engine=\"0\"}} 2.0\n{name}{{engine=\"1\"}} 3\n"
            f"{name}_created 17\nvllm:num_requests_waiting 4\n")
    assert parse_counter(text, name) == 5.0
    assert parse_counter("vllm:num_requests_waiting 4\n", name) is None
    assert parse_counter(f"{name} 0\n", name) == 0.0


def test_good_probes_do_not_bring_a_quarantined_decode_back_early():
    async def scenario():
        async def models(request):
            return web.json_response({"data": [{"id": "m"}]})

        async with loopback_server({"/v1/models": models}) as port:
            pool = WorkerPool()
            d0 = pool.add(WorkerSpec(url=f"http://127.0.0.1:{port}"), "decode")
            config = RouterConfig(decode=[d0.spec], health=HealthSpec(canary=False))
            session = new_session(1.0)
            try:
                upkeep = PoolUpkeep(config, pool, session)
                clock = Clock()
                upkeep.kv.clock = clock
                d0.ever_up, d0.healthy, d0.quarantined_until = True, False, clock.now + 5
                assert await upkeep.check(d0) and not d0.healthy  # probe passes, stays out
                clock.now += 6
                assert await upkeep.check(d0) and d0.healthy      # quarantine over: back
            finally:
                await session.close()

    asyncio.run(scenario())


# -- attribution: a prefill blamed by the verdicts of two decodes ---------------------------------
def test_a_prefill_whose_kv_mismatched_at_two_decodes_within_the_window_is_quarantined():
    clock, (pool, d0, d1) = Clock(), two_decodes()
    p0 = pool.get("http://p0", "prefill")
    p1 = pool.add(WorkerSpec(url="http://p1"), "prefill")
    kv = KvQuarantine(KvVerifySpec(failures=3, window_s=60, quarantine_s=300), clock)
    assert not kv.verdict(p0, d0, 0, pool)            # a clean load blames no one
    assert not kv.verdict(None, d0, 5, pool)          # a local prefill: nobody to blame
    assert not kv.verdict(p0, d0, 2, pool)
    assert not kv.verdict(p0, d0, 1, pool)            # the same decode again: could be the decode
    clock.now += 61
    assert not kv.verdict(p0, d1, 1, pool)            # d0's are out of the window now
    clock.now += 10
    assert kv.verdict(p0, d0, 1, pool)                # two decodes within 60 s
    assert not p0.healthy and p1.healthy and d0.healthy and d1.healthy
    assert p0.quarantined_until == clock.now + 300
    # the decodes' counters rose for p0's KV: those rises no longer count against them
    kv2 = KvQuarantine(KvVerifySpec(failures=3, window_s=60, quarantine_s=300), clock)
    p0.healthy = True
    kv2.observe(d0, 0.0, pool)
    kv2.observe(d0, 2.0, pool)     # 2 mismatches at d0, from p0's KV
    kv2.verdict(p0, d0, 1, pool)
    assert kv2.verdict(p0, d1, 1, pool) and not p0.healthy
    assert not kv2.observe(d0, 3.0, pool) and d0.healthy  # 1 since, not 3
    # p1 is the last usable prefill: spared
    assert not kv.verdict(p1, d0, 1, pool) and not kv.verdict(p1, d1, 1, pool) and p1.healthy


def test_the_proxy_hands_mismatched_verdicts_to_the_attribution():
    proxy, d = bare_proxy(), decision()
    calls = []

    class Recorder:
        def verdict(self, prefill, decode, mismatched, pool):
            calls.append((prefill, decode, mismatched))

    class Ctx:
        pool = WorkerPool()

    proxy.kv_quarantine, proxy.ctx = Recorder(), Ctx()
    proxy._kv_verdict(answer(VERDICT.into(None)), d)
    clean = KvVerdict(verdict="verified", blocks=4, mismatched=0, transport="pull")
    proxy._kv_verdict(answer(clean.into(None)), d)
    assert calls == [(d.prefill, d.decode, 1)]


def test_the_tables_stay_bounded_when_workers_churn(monkeypatch):
    import pd_plugins.routers.kv_quarantine as module
    monkeypatch.setattr(module, "MAX_WORKERS", 4)
    clock, pool = Clock(), WorkerPool()
    kv = KvQuarantine(KvVerifySpec(failures=3, window_s=60, quarantine_s=300), clock)
    first = pool.add(WorkerSpec(url="http://d-first"), "decode")
    kv.observe(first, 0.0, pool)
    for i in range(10):
        d = pool.add(WorkerSpec(url=f"http://d{i}"), "decode")
        kv.observe(d, 0.0, pool)
        kv.verdict(pool.add(WorkerSpec(url=f"http://p{i}"), "prefill"), d, 1, pool)
    assert len(kv._last) == 4 and len(kv._blamed) == 4
    assert first.ordinal not in kv._last  # forgotten: its next look is a baseline again
