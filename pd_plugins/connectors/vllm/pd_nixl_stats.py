"""PdNixlConnector's counters on vLLM's /metrics, next to upstream's vllm:nixl_* ones.

Counted by the worker, carried to the API server in vLLM's KV connector stats, exposed as
Prometheus counters (vLLM adds the `_total` suffix). Expired leases are upstream's
`vllm:nixl_num_kv_expired_reqs` (on the prefill).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from pd_plugins.connectors.vllm.counter_stats import REJECTED_PARAMS_COUNTER

# data key -> (metric name, help)
PD_COUNTERS: dict[str, tuple[str, str]] = {
    **REJECTED_PARAMS_COUNTER,
    "pd_late_reads": (
        "vllm:pd_nixl_late_reads",
        "Pull reads the prefill answered as late (its lease had released the blocks): the data "
        "was discarded and the load failed (decode side)."),
    "pd_lease_check_timeouts": (
        "vllm:pd_nixl_lease_check_timeouts",
        "Pull reads with no lease verdict from the prefill in time: treated as late (decode side)."),
    "pd_unchecked_reads": (
        "vllm:pd_nixl_unchecked_reads",
        "Pull reads from a prefill that offers no lease check (not PdNixlConnector): used "
        "unchecked (decode side)."),
    "pd_push_timeouts": (
        "vllm:pd_nixl_push_timeouts",
        "Push transfers that did not complete by push_timeout_s: the load failed (decode side)."),
    "pd_held_sends": (
        "vllm:pd_nixl_held_sends",
        "Expired push leases whose blocks were kept until an in-flight WRITE finished "
        "(prefill side)."),
    "pd_refused_writes": (
        "vllm:pd_nixl_refused_writes",
        "Push WRITEs not started: the lease had run out or the decode had stopped waiting "
        "(prefill side)."),
    "pd_recomputes": (
        "vllm:pd_nixl_recomputes",
        "Failed KV loads the engine recomputes locally (kv_load_failure_policy=recompute)."),
    "pd_failed_loads": (
        "vllm:pd_nixl_failed_loads",
        "Failed KV loads that end their request with an error (kv_load_failure_policy=fail)."),
}


class PdNixlStats(NixlKVConnectorStats):
    def reset(self) -> None:
        super().reset()
        for key in PD_COUNTERS:
            self.data[key] = []

    def count(self, key: str, n: int = 1) -> None:
        if n:
            self.data[key].append(n)

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(key) for key in PD_COUNTERS)

    def reduce(self) -> dict[str, int | float]:
        reduced = super().reduce()
        for key, (name, _) in PD_COUNTERS.items():
            if total := sum(self.data.get(key, ())):
                reduced[name.removeprefix("vllm:")] = total
        return reduced


class PdNixlPromMetrics(NixlPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.pd_counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                self.per_engine_labelvalues,
            )
            for key, (name, doc) in PD_COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        super().observe(transfer_stats_data, engine_idx)
        for key, counter in self.pd_counters.items():
            for n in transfer_stats_data.get(key, ()):
                counter[engine_idx].inc(n)
