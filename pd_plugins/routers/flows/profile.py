"""What the router knows about one engine, in one place: each engine's module in flows/ registers
one profile, and the router reads its engine's profile instead of testing the engine's name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pd_plugins.routers.config import WorkerSpec
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
