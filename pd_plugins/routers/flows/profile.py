"""What the router knows about one engine, in one place: each engine's module in flows/ registers
one profile, and the router reads its engine's profile instead of testing the engine's name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pd_plugins.routers.config import ConfigError, RouterConfig, WorkerSpec
from pd_plugins.routers.flows.base import PdFlow
from pd_plugins.vocab.engines import Engine, LoadMetricNames, TransferMode


@dataclass(frozen=True)
class EngineProfile:
    name: Engine
    # the PD flow for a transfer mode, given the push head start (vLLM push: decode leg first)
    flow: Callable[[TransferMode, float], PdFlow]
    load_metrics: LoadMetricNames   # the /metrics gauges health.py scrapes for a worker's load
    # whether a decode worker can serve a request alone (deciders, local prefill fallback)
    decode_prefills_locally: bool
    # what a prefill worker's spec lacks for this engine and transfer mode (None: nothing)
    prefill_problem: Callable[[WorkerSpec, TransferMode], str | None]
    # the health canary: GET this path, or None for a one-token generation on /v1/completions
    canary_path: str | None = None

    def check_workers(self, config: RouterConfig) -> None:
        """Refuse, at startup, a configuration whose workers this engine cannot run."""
        for worker in config.prefill:
            problem = self.prefill_problem(worker, config.transfer)
            if problem is not None:
                raise ConfigError(f"prefill {worker.url}: {problem}")
