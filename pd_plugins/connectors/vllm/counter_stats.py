"""Connector counters on vLLM's /metrics, from a table of counters (vLLM adds `_total`).

Counted by the worker, carried to the API server in vLLM's KV connector stats. A connector
declares its table once and subclasses both classes with it (plain subclasses, so the stats
pickle by name between vLLM's processes). A connector built on an upstream one layers `Counters`
and `CounterMetrics` over upstream's stats and metrics classes instead (pd_nixl_stats.py).
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

# data key -> (metric name, help)
CounterTable = dict[str, tuple[str, str]]

# Counted by every pd connector's scheduler side, under one metric name (PdNixlConnector's too).
REJECTED_PARAMS_KEY = "pd_rejected_transfer_params"
REJECTED_PARAMS_COUNTER: CounterTable = {
    REJECTED_PARAMS_KEY: (
        "vllm:pd_rejected_transfer_params",
        "Requests whose kv_transfer_params were not a JSON object (e.g. a value smuggled in "
        "through vllm_xargs): ignored, the request is served without remote KV."),
}


class _WithSharedCounters:
    """Every subclass's COUNTERS also holds the counters all pd connectors share."""

    COUNTERS: CounterTable = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.COUNTERS = {**cls.COUNTERS, **REJECTED_PARAMS_COUNTER}


class Counters(_WithSharedCounters):
    """A stats class's counters from COUNTERS, layered over the stats class below it in the MRO:
    `_NoStats` for a connector of ours, or an upstream one (PdNixlStats over NIXL's), whose own
    keys and summaries it keeps. Upstream methods see only upstream keys."""

    data: dict[str, Any]

    def reset(self) -> None:
        super().reset()
        self.data.update({key: [] for key in self.COUNTERS})

    def count(self, key: str, n: float = 1) -> None:
        if n:
            self.data.setdefault(key, []).append(n)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in self.COUNTERS:
            self.data.setdefault(key, []).extend(other.data.get(key, ()))
        theirs = copy.copy(other)
        theirs.data = {k: v for k, v in other.data.items() if k not in self.COUNTERS}
        super().aggregate(theirs)
        return self

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(key) for key in self.COUNTERS)

    def reduce(self) -> dict[str, int | float]:
        return {**super().reduce(),
                **{name.removeprefix("vllm:"): round(sum(self.data[key]), 6)
                   for key, (name, _) in self.COUNTERS.items() if self.data.get(key)}}


class _NoStats(KVConnectorStats):
    """Below `Counters` when no upstream stats class is: nothing of its own."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return self

    def is_empty(self) -> bool:
        return True

    def reduce(self) -> dict[str, int | float]:
        return {}


class CounterStats(Counters, _NoStats):
    COUNTERS: CounterTable = {}


class CounterMetrics(_WithSharedCounters):
    """Prometheus counters from COUNTERS, layered over the metrics class below it in the MRO
    (`_NoMetrics`, or an upstream one such as NIXL's, which keeps its own metrics)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                self.per_engine_labelvalues,
            )
            for key, (name, doc) in self.COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        super().observe(transfer_stats_data, engine_idx)
        for key, counter in self.counters.items():
            for n in transfer_stats_data.get(key, ()):
                counter[engine_idx].inc(n)


class _NoMetrics(KVConnectorPromMetrics):
    """Below `CounterMetrics` when no upstream metrics class is."""

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        return


class CounterPromMetrics(CounterMetrics, _NoMetrics):
    COUNTERS: CounterTable = {}
