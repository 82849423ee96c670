"""The connectors' counters (counter_stats.py): on their own (PdShmStats) and layered over
upstream's NIXL stats (PdNixlStats), as vLLM moves them: counted in a worker, pickled to the API
server, aggregated over steps, reduced for the log line and observed into Prometheus."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from pd_plugins.connectors.vllm.counter_stats import REJECTED_PARAMS_KEY  # noqa: E402
from pd_plugins.connectors.vllm.pd_nixl_stats import (  # noqa: E402
    PdNixlPromMetrics,
    PdNixlStats,
)
from pd_plugins.connectors.vllm.pd_shm_stats import PdShmPromMetrics, PdShmStats  # noqa: E402


def over_the_wire(stats):
    return pickle.loads(pickle.dumps(stats))


def test_pool_counters_count_aggregate_and_reduce():
    stats = PdShmStats()
    assert stats.is_empty()
    stats.count("stored_blocks", 3)
    stats.count("stored_blocks", 0)  # nothing to count: not an observation
    stats.count(REJECTED_PARAMS_KEY)
    other = PdShmStats()
    other.count("stored_blocks", 2)
    total = over_the_wire(stats).aggregate(over_the_wire(other))
    assert total.data["stored_blocks"] == [3, 2]
    assert total.reduce() == {"pd_shm_stored_blocks": 5, "pd_rejected_transfer_params": 1}
    assert not total.is_empty()
    assert PdShmStats(data=dict(total.data)).reduce() == total.reduce()


def test_nixl_counters_sit_beside_upstream_nixl_stats():
    stats = PdNixlStats()
    assert stats.is_empty()
    assert "num_failed_transfers" in stats.data and "pd_late_reads" in stats.data
    stats.count("pd_late_reads")
    assert not stats.is_empty()  # our counters alone are worth reporting
    stats.record_failed_transfer()  # upstream's own recording still works
    other = PdNixlStats()
    other.count("pd_late_reads", 2)
    other.count(REJECTED_PARAMS_KEY)
    other.record_failed_transfer()
    total = over_the_wire(stats).aggregate(over_the_wire(other))
    assert total.data["pd_late_reads"] == [1, 2]  # each observation once
    assert total.data["num_failed_transfers"] == [1, 1]
    reduced = total.reduce()
    assert reduced["pd_nixl_late_reads"] == 3
    assert reduced["pd_rejected_transfer_params"] == 1
    assert reduced["Num failed transfers"] == 2  # upstream's summary is kept
    assert total.clone_and_reset().data["pd_late_reads"] == [1, 2]
    assert total.is_empty() and total.data["pd_late_reads"] == []


def test_nixl_upstream_only_stats_aggregate_without_our_keys_counted_twice():
    stats, other = PdNixlStats(), PdNixlStats()
    other.record_failed_handshake()
    stats.aggregate(other)
    assert stats.data["num_failed_handshakes"] == [1]
    assert all(stats.data[key] == [] for key in PdNixlStats.COUNTERS)


@pytest.mark.parametrize("metrics_cls, stats_cls, key, metric", [
    (PdShmPromMetrics, PdShmStats, "loaded_blocks", "vllm:pd_shm_loaded_blocks"),
    (PdNixlPromMetrics, PdNixlStats, "pd_push_timeouts", "vllm:pd_nixl_push_timeouts"),
])
def test_counters_reach_prometheus(metrics_cls, stats_cls, key, metric):
    registry = CollectorRegistry()

    def registered(cls):
        return lambda *args, **kwargs: cls(*args, registry=registry, **kwargs)

    types = {t: registered(t) for t in (Gauge, Counter, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = metrics_cls(config, types, ["engine"], {0: ["0"]})
    stats = stats_cls()
    stats.count(key, 4)
    stats.count(REJECTED_PARAMS_KEY)
    metrics.observe(over_the_wire(stats).data, 0)
    assert registry.get_sample_value(metric + "_total", {"engine": "0"}) == 4
    assert registry.get_sample_value("vllm:pd_rejected_transfer_params_total",
                                     {"engine": "0"}) == 1
