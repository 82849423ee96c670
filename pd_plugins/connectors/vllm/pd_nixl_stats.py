"""PdNixlConnector's counters on vLLM's /metrics, next to upstream's vllm:nixl_* ones.

Counted by the worker, carried to the API server in vLLM's KV connector stats, exposed as
Prometheus counters (vLLM adds the `_total` suffix): counter_stats.py's counters layered over
upstream's NIXL stats and metrics, and the verification counters every transport shares
(kv_verdicts.py). Expired leases are upstream's
`vllm:nixl_num_kv_expired_reqs` (on the prefill).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)

from pd_plugins.connectors.vllm.counter_stats import CounterMetrics, Counters, CounterTable
from pd_plugins.connectors.vllm.kv_verdicts import KV_VERIFY_COUNTERS

# beside upstream's; the counters every pd connector shares are added by `Counters`
PD_COUNTERS: CounterTable = {
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
    "pd_refused_reads": (
        "vllm:pd_nixl_refused_reads",
        "Pull reads that could not start (a block id past the prefill's KV cache, or the "
        "read's start raised): the load failed instead of the engine (decode side)."),
    "pd_recomputes": (
        "vllm:pd_nixl_recomputes",
        "Failed KV loads the engine recomputes locally (kv_load_failure_policy=recompute)."),
    "pd_failed_loads": (
        "vllm:pd_nixl_failed_loads",
        "Failed KV loads that end their request with an error (kv_load_failure_policy=fail)."),
    "pd_missing_digests": (
        "vllm:pd_nixl_missing_digests",
        "Prefills whose decode gets no digests of their blocks (pull: none came from the "
        "worker in time; push: a WRITE sent without them): their decodes load them "
        "`unverified` (prefill side)."),
    "pd_dropped_notifs": (
        "vllm:pd_nixl_dropped_notifs",
        "NIXL notifications dropped before upstream's parser, which would have raised on them "
        "and ended the engine: not a heartbeat, push registration or `<request id>:<count>`, "
        "not UTF-8, or a KV digest notification this engine does not take (both sides)."),
    # verified loads (vllm:pd_kv_*, shared with every verifying transport; decode side)
    **KV_VERIFY_COUNTERS,
}


class PdNixlStats(Counters, NixlKVConnectorStats):
    COUNTERS = PD_COUNTERS


class PdNixlPromMetrics(CounterMetrics, NixlPromMetrics):
    COUNTERS = PD_COUNTERS
