"""PdShmConnector's counters on vLLM's /metrics (vLLM adds the `_total` suffix).

Pool hits as the scheduler saw them are vLLM's own `vllm:external_prefix_cache_hits` / `_queries`.
The verification counters (`vllm:pd_kv_*`) are the ones every verifying transport shares
(kv_verdicts.py).
"""

from __future__ import annotations

from pd_plugins.connectors.vllm.counter_stats import CounterPromMetrics, CounterStats
from pd_plugins.connectors.vllm.kv_verdicts import KV_VERIFY_COUNTERS

SHM_COUNTERS: dict[str, tuple[str, str]] = {
    "stored_blocks": ("vllm:pd_shm_stored_blocks", "KV blocks written into the pool."),
    "present_blocks": (
        "vllm:pd_shm_present_blocks",
        "KV blocks not written because the pool already had them (same prefix hash)."),
    "unstored_blocks": (
        "vllm:pd_shm_unstored_blocks",
        "KV blocks that could not be stored: every slot held or pinned, or a write lease lost."),
    "loaded_blocks": ("vllm:pd_shm_loaded_blocks", "KV blocks copied from the pool."),
    "failed_blocks": (
        "vllm:pd_shm_failed_blocks",
        "KV blocks whose load failed (gone from the pool, replaced while copied, or a checksum "
        "mismatch, which vllm:pd_kv_mismatched_blocks counts apart): recomputed or failed per "
        "kv_load_failure_policy."),
    "discarded_blocks": (
        "vllm:pd_shm_discarded_blocks",
        "Pool slots dropped by a reader because their bytes failed their checksum."),
    "stored_bytes": ("vllm:pd_shm_stored_bytes", "Bytes written into the pool."),
    "loaded_bytes": ("vllm:pd_shm_loaded_bytes", "Bytes copied from the pool."),
    "store_seconds": ("vllm:pd_shm_store_seconds", "Time spent writing into the pool."),
    "load_seconds": ("vllm:pd_shm_load_seconds", "Time spent copying from the pool."),
    **KV_VERIFY_COUNTERS,
}


class PdShmStats(CounterStats):
    COUNTERS = SHM_COUNTERS


class PdShmPromMetrics(CounterPromMetrics):
    COUNTERS = SHM_COUNTERS
