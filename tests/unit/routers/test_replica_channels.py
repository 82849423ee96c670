"""The replica channels (routers/replica_channels.py) between two replicas' tables, handed their
entries directly: what the Redis stream carries (tests/router/test_replica_sync.py) is exactly
these lists."""

from __future__ import annotations

import msgspec
import pytest

from pd_plugins.routers.config import SessionSpec, WorkerSpec
from pd_plugins.routers.policy.base import RequestInfo
from pd_plugins.routers.policy.prefix_index import PrefixIndex
from pd_plugins.routers.policy.latency_model import LatencyModels
from pd_plugins.routers.replica_channels import (
    MAX_PEER_LOAD, MAX_PEERS, LatencyChannel, LoadChannel, PinChannel, PrefixChannel, ReplicaShare,
)
from pd_plugins.routers.sessions import SessionTable
from pd_plugins.routers.workers import WorkerPool


def _wire(items):
    """Through msgpack and back, as the stream carries them."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(items))


def info(keys, session_id=None, tokens=None) -> RequestInfo:
    return RequestInfo(session_id=session_id, block_keys=list(keys), prompt_tokens=tokens or 16 * len(keys))


def test_pins_named_and_detected_sessions_cross_replicas():
    a, b = SessionTable(SessionSpec()), SessionTable(SessionSpec())
    pins_a, pins_b = PinChannel(a, "ra"), PinChannel(b, "rb")
    # Replica A serves a named conversation and one found by detection (no id).
    named = info([1, 2, 3], "c1")
    a.resolve(named)
    pins_a.recorded(a.record(named, "http://d1"))
    anon = info([7, 8, 9])
    a.resolve(anon)
    auto_id = a.record(anon, "http://d2")
    assert auto_id.startswith("auto-ra-")  # unique across replicas
    pins_a.recorded(auto_id)
    items = pins_a.take(0.0)
    assert pins_a.take(0.0) is None  # taken once
    pins_b.apply("ra", _wire(items), 0.0)
    assert b.counts["replica_adopted"] == 2
    # Replica B: the named turn 2 follows the pin; the anonymous turn 2 is detected from its prefix.
    two = info([1, 2, 3, 4], "c1")
    b.resolve(two)
    assert (two.pinned_decode, two.turn) == ("http://d1", 1)
    anon2 = info([7, 8, 9, 10, 11])
    b.resolve(anon2)
    assert (anon2.session_id, anon2.pinned_decode, anon2.turn) == (auto_id, "http://d2", 1)
    pins_b.recorded(b.record(anon2, "http://d2"))
    # Back on A: B's turn 2 is newer (2 turns) and its chain key extends detection there.
    pins_a.apply("rb", _wire(pins_b.take(0.0)), 0.0)
    three = info([7, 8, 9, 10, 11, 12])
    a.resolve(three)
    assert (three.session_id, three.turn) == (auto_id, 2)
    # An older copy (fewer turns) never replaces a newer local one.
    pins_a.apply("rb", [[auto_id, "http://elsewhere", 1, 16, 9, True]], 0.0)
    assert a.get(auto_id).decode_url == "http://d2"


def test_pins_pending_table_is_bounded_and_survives_a_failed_publish():
    table = SessionTable(SessionSpec())
    pins = PinChannel(table, "r", max_pending=3)
    for n in range(5):
        request = info([n + 1], f"s{n}")
        table.resolve(request)
        pins.recorded(table.record(request, "http://d"))
    assert table.counts["replica_dropped"] == 2
    items = pins.take(0.0)
    assert [i[0] for i in items] == ["s2", "s3", "s4"]
    pins.put_back(items)  # Redis was down
    assert [i[0] for i in pins.take(1.0)] == ["s2", "s3", "s4"]


def _pool():
    pool = WorkerPool()
    for role, url in (("prefill", "http://p"), ("decode", "http://d1"), ("decode", "http://d2")):
        pool.add(WorkerSpec(url), role)
    return pool


def test_loads_add_the_peers_share_and_replace_it():
    pool_a, pool_b = _pool(), _pool()
    loads_a, loads_b = LoadChannel(lambda: pool_a, ttl_s=2.0), LoadChannel(lambda: pool_b, ttl_s=2.0)
    d1_a, d1_b = pool_a.get("http://d1", "decode"), pool_b.get("http://d1", "decode")
    d1_a.in_flight, d1_a.in_flight_tokens = 3, 300
    loads_b.apply("ra", _wire(loads_a.take(0.0)), 0.0)
    assert (d1_b.in_flight, d1_b.in_flight_tokens) == (3, 300)
    # B's own requests add to it, and B publishes only its own.
    d1_b.in_flight += 1
    assert loads_b.own(d1_b) == (1, 0, 0)
    loads_a.apply("rb", _wire(loads_b.take(0.0)), 0.0)
    assert d1_a.in_flight == 4 and loads_a.own(d1_a) == (3, 0, 300)
    # A's requests end: its next snapshot (empty) replaces, never accumulates.
    d1_a.in_flight -= 3 + 0
    d1_a.in_flight_tokens -= 300
    assert loads_a.take(0.1) == [["", "", 0, 0, 0]]
    assert loads_a.take(0.2) is None  # unchanged and idle: nothing to say
    loads_b.apply("ra", _wire([["", "", 0, 0, 0]]), 0.1)
    assert (d1_b.in_flight, d1_b.in_flight_tokens) == (1, 0)
    # A peer silent past ttl_s counts nothing.
    loads_a.apply("rb", [["decode", "http://d2", 5, 50, 500]], 1.0)
    d2_a = pool_a.get("http://d2", "decode")
    assert d2_a.in_flight == 5
    loads_a.tick(2.5)
    assert d2_a.in_flight == 5  # 1.5 s old: still counted
    loads_a.tick(3.5)
    assert (d2_a.in_flight, d2_a.in_flight_prefill_tokens, d2_a.in_flight_tokens) == (0, 0, 0)


def test_loads_leave_a_removed_worker_with_its_own_counts():
    pool = _pool()
    loads = LoadChannel(lambda: pool)
    loads.apply("rb", [["decode", "http://d2", 4, 0, 40]], 0.0)
    worker = pool.get("http://d2", "decode")
    worker.in_flight += 1  # one of ours
    pool.remove("http://d2", "decode")
    loads.tick(0.1)
    assert worker.in_flight == 1 and worker.in_flight_tokens == 0


def test_prefixes_another_replica_names_for_a_worker_not_here_are_not_kept():
    index = PrefixIndex()
    prefixes = PrefixChannel(index, known=lambda url: url == "http://d1")
    prefixes.apply("ra", [[["http://d1", "http://gone"], [11, 12]]], 0.0)
    assert index.matched_blocks("http://d1", [11, 12]) == 2
    assert "http://gone" not in index._blocks  # no table for it, however many a peer names


def test_prefixes_learned_by_routing_reach_the_other_index():
    index_a, index_b = PrefixIndex(), PrefixIndex()
    share = ReplicaShare(None, PrefixChannel(index_a, max_pending=2))
    prefixes_b = PrefixChannel(index_b)
    share.served("", info([11, 12, 13]), "http://d1", "http://p")
    items = share.prefixes.take(0.0)
    prefixes_b.apply("ra", _wire(items), 0.0)
    assert index_b.matched_blocks("http://d1", [11, 12, 13, 14]) == 3
    assert index_b.matched_blocks("http://p", [11, 12]) == 2
    # Workers with KV events are not shared (every replica hears their events itself).
    index_a.exact_workers.add("http://d1")
    share.served("", info([21]), "http://d1", None)
    assert share.prefixes.take(0.0) is None
    # Bounded: the oldest go first.
    for n in range(3):
        share.served("", info([30 + n]), "http://d2", None)
    assert [keys for _, keys in share.prefixes.take(0.0)] == [[31], [32]] and share.prefixes.dropped == 1


def test_latency_samples_reach_the_other_fit_so_both_leave_the_priors_together():
    models_a, models_b = LatencyModels(), LatencyModels()
    latency_a, latency_b = LatencyChannel(models_a, max_pending=100), LatencyChannel(models_b)
    prior = models_b.prefill.coefficients
    # A runs every leg (as one replica of two sees half of them): prefill 10 ms + 20 us per token.
    for tokens in range(1_000, 11_000, 1_000):
        models_a.prefill.observe(tokens, 0.01 + 2e-5 * tokens)
    models_a.decode_step.observe(8, 0.03)
    latency_b.apply("ra", _wire(latency_a.take(0.0)), 0.0)
    assert models_b.prefill.n == 10 and models_b.decode_step.n == 1
    assert models_b.prefill.coefficients == models_a.prefill.coefficients != prior
    assert abs(models_b.prefill_s(10_000) - 0.21) < 1e-6  # the prior said 2.02 s: a 429 at 1.5 s
    # Learned from a peer: not published again (no echo between replicas).
    assert latency_b.take(0.0) is None and latency_a.take(0.0) is None
    # Unreadable samples are skipped; a fit this version lacks too.
    latency_b.apply("ra", [["prefill", float("nan"), 1.0], ["prefill", 5, -1.0], ["queue", 1, 1]], 0.0)
    assert models_b.prefill.n == 10
    # Bounded while Redis is down: the oldest samples go first.
    for tokens in range(150):
        models_a.prefill.observe(tokens, 0.01)
    items = latency_a.take(0.0)
    latency_a.put_back(items)
    assert latency_a.dropped == 50 and latency_a.take(0.0) == items[-100:] == [
        ["prefill", t, 0.01] for t in range(50, 150)]


def test_sync_settings_are_checked():
    from pd_plugins.routers.config import ConfigError, config_from_mapping

    base = {"decode": [{"url": "http://d1"}], "sessions": {"redis_url": "redis://127.0.0.1:6379/0"}}
    config_from_mapping(base)  # the defaults pass
    for bad, message in (({"sync_interval_s": 0}, "sync_interval_s"),
                         ({"peer_load_ttl_s": 0.05}, "peer_load_ttl_s"),
                         ({"redis_stream_len": 1}, "redis_stream_len")):
        with pytest.raises(ConfigError, match=message):
            config_from_mapping({**base, "sessions": {**base["sessions"], **bad}})


def test_a_peer_latency_sample_out_of_any_engines_range_is_not_learned():
    # finite is not enough: 1e200 squared is inf, and the fit's slope stayed 0 for good
    models = LatencyModels()
    channel = LatencyChannel(models)
    for x in range(100, 2100, 100):
        channel.apply("rb", [["prefill", x, 0.01 + 1e-4 * x]], 0.0)
    before = models.prefill.coefficients
    channel.apply("rb", [["prefill", 1e200, 0.0], ["prefill", 5.0, 1e9], ["prefill", -1, 1]], 0.0)
    assert models.prefill.coefficients == before and before[1] > 0


def test_a_prefix_backlog_goes_out_in_entries_of_bounded_size():
    # after a Redis outage thousands of long prompts may wait: one entry of them all would pass
    # what a replica reads (replica_sync.MAX_ENTRY_BYTES) and be dropped whole
    channel = PrefixChannel(PrefixIndex())
    channel.max_keys_per_take = 10
    for n in range(5):
        channel.routed([f"http://d{n}"], list(range(4)))
    assert [len(channel.take(0.0)) for _ in range(2)] == [3, 2]  # 12 keys, then the rest
    assert channel.take(0.0) is None


def _known(pool):
    # what a model group passes (ModelGroup.has_worker): its pool, in either role
    return lambda url: pool.get(url, "prefill") is not None or pool.get(url, "decode") is not None


def test_prefixes_are_kept_under_the_pools_own_url_whatever_a_peer_spells():
    # the pool finds http://d1/ as http://d1: stored as spelled, each spelling took a table of
    # its own (up to 200,000 blocks each) that removing the worker never dropped
    pool, index = _pool(), PrefixIndex()
    prefixes = PrefixChannel(index, known=_known(pool))
    prefixes.apply("ra", [[[f"http://d1{'/' * n}"], [11, 12]] for n in range(1, 300)], 0.0)
    assert list(index._blocks) == ["http://d1"]
    index.forget_worker(pool.remove("http://d1", "decode").url)  # as ModelGroup.remove does
    assert not index._blocks


def test_a_prefix_item_names_two_workers_and_integer_keys_or_is_skipped():
    pool, index = _pool(), PrefixIndex()
    prefixes = PrefixChannel(index, known=_known(pool))
    prefixes.apply("ra", [[["http://gone", "http://gone/", "http://d1"], [11]],  # a third url
                          [["http://d2"], [11, "12", [13]]],                      # not block keys
                          [["http://p", "http://d2"], [21, 22]]], 0.0)
    assert index.held_blocks("http://d1") == 0 and index.held_blocks("http://d2") == 2
    assert index.matched_blocks("http://p", [21, 22]) == 2


def test_a_peers_pin_is_kept_only_for_a_decode_worker_of_this_pool_under_its_url():
    pool, table = _pool(), SessionTable(SessionSpec())
    pins = PinChannel(table, "rb", known=_known(pool))
    pins.apply("ra", [["s1", "http://d1/", 1, 16, 5, False],
                      ["s2", "http://x" + "y" * 100_000, 1, 16, None, False],  # not a worker here
                      ["s3", "http://elsewhere", 1, 16, None, False],
                      ["s4", "http://d2", 1.5, 16, None, False],               # not counts
                      ["s5", "http://d2", 1, 16, "7", False]], 0.0)
    assert table.get("s1").decode_url == "http://d1"  # found when http://d1 leaves
    assert [s for s in ("s2", "s3", "s4", "s5") if table.get(s)] == []
    assert table.counts["replica_refused"] == 4
    assert table.forget_worker("http://d1") == 1
    # without a pool to check (known: every URL), the length bound still holds
    alone = SessionTable(SessionSpec())
    PinChannel(alone, "rc").apply("ra", [["s2", "http://x" + "y" * 100_000, 1, 16, None, False]], 0.0)
    assert alone.get("s2") is None


def test_a_peers_prefix_entry_applies_no_more_keys_than_one_take_holds():
    # small keys are a byte each: an 8 MB entry held millions, seconds of the event loop
    pool, index = _pool(), PrefixIndex()
    prefixes = PrefixChannel(index, max_keys=4, known=_known(pool))
    prefixes.max_keys_per_take = 10
    prefixes.apply("ra", [[["http://d1"], [4 * n + k for k in range(4)]] for n in range(100)], 0.0)
    assert index.held_blocks("http://d1") == 14  # what a take of 10 keys (+ one item) may hold


def test_a_peers_loads_count_for_this_pools_workers_each_bounded():
    # one row of 2**62 requests kept every request off d1 (and blocked a role move's drain)
    pool = _pool()
    loads = LoadChannel(lambda: pool)
    d1, d2 = pool.get("http://d1", "decode"), pool.get("http://d2", "decode")
    loads.apply("rb", [["decode", "http://d1", 2**62, 2**62, 2**62],
                       ["decode", "http://d2/", 5, 0, 0],        # not how the pool names d2
                       ["decode", "http://d2", 1.5, 0, 0],       # not counts
                       ["decode", "http://d2", float("inf"), 0, 0],
                       ["prefill", "http://d2", 7, 0, 0],        # d2 is no prefill
                       *(["decode", f"http://gone{n}", 1, 1, 1] for n in range(1000))], 0.0)
    assert (d1.in_flight, d1.in_flight_prefill_tokens, d1.in_flight_tokens) == MAX_PEER_LOAD
    assert d2.in_flight == 0
    assert list(loads._peers["rb"][1]) == [("decode", "http://d1")]  # no rows kept for the rest
    loads.apply("rb", [], 0.1)
    assert d1.in_flight == 0


def test_loads_of_more_replicas_than_any_deployment_wait_for_one_to_go_quiet():
    pool = _pool()
    loads = LoadChannel(lambda: pool, ttl_s=2.0)
    d1 = pool.get("http://d1", "decode")
    for n in range(MAX_PEERS):
        loads.apply(f"r{n}", [["decode", "http://d1", 1, 0, 0]], 0.0)
    with pytest.raises(ValueError, match="replicas"):  # the sync counts it unreadable
        loads.apply("one-more", [["decode", "http://d1", 1, 0, 0]], 1.0)
    loads.apply("r0", [["decode", "http://d1", 2, 0, 0]], 1.0)  # a known one goes on
    assert d1.in_flight == MAX_PEERS + 1
    loads.tick(2.5)  # all but r0 went quiet
    loads.apply("one-more", [["decode", "http://d1", 1, 0, 0]], 2.5)
    assert d1.in_flight == 3
