"""Engine and transfer-mode names, and the engine gauges that tell the router a worker's load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Engine = Literal["vllm", "sglang"]
ENGINES: tuple[str, ...] = get_args(Engine)

# pull: the decode READs the prefill's blocks (NIXL); push: the prefill WRITEs into the decode's
# (NIXL); shm, lmcache: both map a shared pool (PdShmConnector, PdLMCacheConnector)
TransferMode = Literal["pull", "push", "shm", "lmcache"]
TRANSFER_MODES: tuple[str, ...] = get_args(TransferMode)


@dataclass(frozen=True)
class LoadMetricNames:
    """The three gauges (Prometheus names) an engine exports for its load."""

    waiting: str   # requests queued
    running: str   # requests being served
    kv_usage: str  # fraction of KV cache in use, 0..1

    def __iter__(self):
        return iter((self.waiting, self.running, self.kv_usage))


LOAD_METRICS: dict[str, LoadMetricNames] = {
    "vllm": LoadMetricNames("vllm:num_requests_waiting", "vllm:num_requests_running",
                            "vllm:kv_cache_usage_perc"),
    "sglang": LoadMetricNames("sglang:num_queue_reqs", "sglang:num_running_reqs",
                              "sglang:token_usage"),
}


def load_metrics_text(engine: str, waiting: float, running: float, kv_usage: float) -> str:
    """The three gauges in Prometheus text form, as `engine` writes them (for mock engines)."""
    names = LOAD_METRICS[engine]
    return (f"{names.waiting} {waiting}\n{names.running} {running}\n"
            f"{names.kv_usage} {kv_usage:.6f}\n")
