"""The worker pool: every prefill and decode server the router knows, with its live state.

State comes from three places: the router's own accounting (in-flight requests and prefill tokens,
updated around every leg), active health checks (health.py), and each engine's /metrics scraped on
an interval (waiting queue, KV usage). Policies read it; only the proxy and the checkers write it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator, Literal

from pd_plugins.routers.config import WorkerConflict, WorkerSpec
from pd_plugins.routers.policy.expert_signature import ExpertFootprint

Role = Literal["prefill", "decode"]


@dataclass(eq=False)
class Worker:
    spec: WorkerSpec
    role: Role
    healthy: bool = True
    draining: bool = False          # removed, or leaving its role: finishing what it holds
    removed: bool = False           # no longer in its pool (its requests in flight finish)
    moving_to: Role | None = None   # a role change in progress (model_group.move_worker)
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_probe: float = 0.0         # monotonic time of the last health probe
    ever_up: bool = False           # a probe has succeeded at least once
    probing: bool = False           # a health probe is in flight (one at a time)
    in_flight: int = 0              # requests with a leg running on this worker now
    # this replica's share of in_flight: other router replicas' loads (replica_channels
    # LoadChannel) are added to in_flight, but only requests of this process can be waited for
    own_in_flight: int = 0
    in_flight_prefill_tokens: int = 0  # uncached prompt tokens queued for prefill here
    in_flight_tokens: int = 0       # prompt tokens of every request in flight here (KV it holds)
    engine_waiting: float = 0.0     # scraped: requests waiting in the engine queue
    engine_running: float = 0.0     # scraped: requests running in the engine
    kv_usage: float = 0.0           # scraped: KV cache usage, 0..1
    last_scrape: float = 0.0
    models: tuple[str, ...] = ()    # from its /v1/models: the base model and its adapters
    adapter_parents: dict[str, str] = field(default_factory=dict)  # adapter id -> base (`parent`)
    model: str = ""                 # the model group it serves ("": the one unnamed group)
    max_model_len: int | None = None
    # monotonic time until which KV mismatches keep it out (kv_quarantine.py): probes wait
    quarantined_until: float = 0.0
    ordinal: int = field(default_factory=itertools.count().__next__)
    # decode: expert histograms of the MoE requests running here (ELDR, expert_locality.py)
    experts: ExpertFootprint = field(default_factory=ExpertFootprint)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining

    @property
    def load(self) -> float:
        """Requests this worker has to get through: the router's in-flight count, or the engine's
        own queue when other clients load it too."""
        return max(float(self.in_flight), self.engine_waiting + self.engine_running)

    def record_success(self) -> None:
        self.consecutive_failures = 0

    def record_failure(self, failure_threshold: int) -> bool:
        """Count a failed leg or probe; True when this one took the worker down."""
        self.consecutive_successes = 0
        self.consecutive_failures += 1
        if self.healthy and self.consecutive_failures >= failure_threshold:
            self.healthy = False
            return True
        return False

    def __repr__(self) -> str:
        return f"Worker({self.role} {self.url})"


class WorkerPool:
    """One model's workers (`model`: its name, "" for the unnamed group of a config without
    `models:`)."""

    def __init__(self, model: str = "") -> None:
        self.model = model
        self._workers: dict[tuple[Role, str], Worker] = {}

    def add(self, spec: WorkerSpec, role: Role, probe_first: bool = False) -> Worker:
        """A new worker; with `probe_first` it takes no requests until a health probe passed
        (the router's choice: a worker that accepts connections but never answers must not get
        traffic while its first probe waits out the timeout). WorkerConflict for the role the
        same URL is moving into."""
        key = (role, spec.url)
        other = self._workers.get(("decode" if role == "prefill" else "prefill", spec.url))
        if other is not None and other.moving_to == role:
            # the move puts that worker in `role` when its drain ends: it would replace this one
            raise WorkerConflict(f"worker {spec.url} is moving to {role} (a role change "
                                 "draining): it serves that role once the move ends")
        existing = self._workers.get(key)
        if existing is not None:
            if existing.moving_to is None:  # a worker leaving this role stays out of it
                existing.draining = False
            return existing
        worker = Worker(spec, role, healthy=not probe_first, model=self.model)
        self._workers[key] = worker
        return worker

    def remove(self, url: str, role: Role) -> Worker | None:
        """Stop routing new requests to a worker; requests it holds finish normally."""
        worker = self._workers.pop((role, url.rstrip("/")), None)
        if worker is not None:
            worker.draining = worker.removed = True
        return worker

    def move(self, worker: Worker, to: Role) -> None:
        """The same worker (health, load, what it holds) now in the other pool."""
        del self._workers[(worker.role, worker.url)]
        worker.role = to
        self._workers[(to, worker.url)] = worker

    def get(self, url: str, role: Role) -> Worker | None:
        return self._workers.get((role, url.rstrip("/")))

    def by_role(self, role: Role) -> list[Worker]:
        return [w for w in self._workers.values() if w.role == role]

    def usable(self, role: Role) -> list[Worker]:
        return [w for w in self._workers.values() if w.role == role and w.usable]

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def snapshot(self) -> list[dict]:
        now = time.monotonic()
        model = {"model": self.model} if self.model else {}
        return [{
            **model, "url": w.url, "role": w.role, "healthy": w.healthy, "in_flight": w.in_flight,
            "in_flight_prefill_tokens": w.in_flight_prefill_tokens,
            "in_flight_tokens": w.in_flight_tokens,
            "engine_waiting": w.engine_waiting, "engine_running": w.engine_running,
            "kv_usage": w.kv_usage,
            "metrics_age_s": round(now - w.last_scrape, 1) if w.last_scrape else None,
            "kv_both": w.spec.kv_both, "moving_to": w.moving_to,
        } for w in self]
