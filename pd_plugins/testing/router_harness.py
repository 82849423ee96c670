"""pd-router and pd-mock-engine as managed processes (for tests, benchmarks and the demo)."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import requests
import yaml

from pd_plugins.routers import native
from pd_plugins.testing.processes import ManagedProcess, free_port


def pinned(cmd: list[str], cpu: str | None) -> list[str]:
    return ["taskset", "-c", cpu, *cmd] if cpu is not None else cmd


@dataclass
class MockEngineProcess(ManagedProcess):
    name: str
    role: str = "both"                 # prefill | decode | both
    engine: str = "vllm"
    args: tuple[str, ...] = ()         # more pd-mock-engine flags (delays, faults)
    cpu: str | None = None
    side_port: int = field(default_factory=free_port)
    engine_id: str | None = None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "pd_plugins.mock.engine", "--port", str(self.port),
               "--side-port", str(self.side_port), "--role", self.role, "--engine", self.engine,
               *(["--engine-id", self.engine_id] if self.engine_id else []), *self.args]
        return pinned(cmd, self.cpu)

    def worker_arg(self) -> list[str]:
        """This engine as a pd-router --prefill/--decode value."""
        extra = []
        if self.role == "prefill" and self.engine == "sglang":
            extra = [f"bootstrap_port={self.side_port}"]
        elif self.role == "prefill" and self.engine_id:
            extra = [f"engine_id={self.engine_id}", f"kv_port={self.side_port}"]
        return [self.url, *extra]

    def stats(self) -> dict:
        return requests.get(f"{self.url}/mock/stats", timeout=5).json()

    def bodies(self) -> list[dict]:
        """The last request bodies this engine received (canaries aside), oldest first."""
        return requests.get(f"{self.url}/mock/bodies", timeout=5).json()["bodies"]

    def set_faults(self, **faults: float) -> dict:
        return requests.post(f"{self.url}/mock/faults", json=faults, timeout=5).json()


@dataclass
class RouterProcess(ManagedProcess):
    name: str
    prefill: list[list[str]] = field(default_factory=list)
    decode: list[list[str]] = field(default_factory=list)
    args: tuple[str, ...] = ()
    config: dict | None = None         # written to a YAML file and passed with --config
    cpu: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.health_path = "/ready"  # up once a decode worker passed its health check

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "pd_plugins.routers", "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        for role in ("prefill", "decode"):
            for worker in getattr(self, role):
                cmd += [f"--{role}", *worker]
        if self.config is not None:
            path = Path(self.log_dir) / f"{self.name}.yaml"
            path.write_text(yaml.safe_dump(self.config))
            cmd += ["--config", str(path)]
        return pinned(cmd, self.cpu)

    def environment(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def wait_healthy(self, timeout: float = 240.0) -> ManagedProcess:
        super().wait_healthy(timeout)
        if self.expects_native():  # the router runs what was built for it (routers/native.py)
            said = [line for line in self.log_path.read_text(errors="replace").splitlines()
                    if "hot path: interpreted" in line]
            if said:
                raise RuntimeError(f"{self.name} runs its hot path interpreted although a native "
                                   f"build of these sources exists: {said[0]}")
        return self

    def expects_native(self) -> bool:
        """A build of this checkout's sources exists, and the router is not told to ignore it."""
        return not native.switched_off(self.environment()) and native.built(native.build_dir())

    def metrics(self) -> str:
        return requests.get(f"{self.url}/metrics", timeout=10).text


@contextlib.contextmanager
def modelled_deployment(hardware: str, prefills: int, decodes: int, policy: str, *, speedup: float,
                        block_size: int, scrape_s: float, log_dir: Path
                        ) -> Iterator[tuple[RouterProcess, list[MockEngineProcess]]]:
    """pd-router (`--policy policy`) in front of latency-modelled mocks (`--latency-model
    hardware`) that publish KV events to it: the HTTP instrument of the routing studies."""
    modelled = ("--latency-model", hardware, "--speedup", str(speedup), "--block-size", str(block_size),
                "--max-model-len", "200000")
    engines, workers = [], {"prefill": [], "decode": []}
    for role, count in (("prefill", prefills), ("decode", decodes)):
        for i in range(count):
            events = f"tcp://127.0.0.1:{free_port()}"
            engine = MockEngineProcess(f"{role}{i}", role=role, log_dir=log_dir,
                                       args=(*modelled, "--kv-events", events))
            engines.append(engine)
            workers[role].append([*engine.worker_arg(), f"kv_events={events}"])
    router = RouterProcess("router", prefill=workers["prefill"], decode=workers["decode"],
                           args=("--policy", policy, "--log-level", "warning"), log_dir=log_dir,
                           config={"block_size": block_size,
                                   "health": {"interval_s": 5.0, "metrics_interval_s": scrape_s}})
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_healthy(60)
        router.start()
        router.wait_healthy(60)
        yield router, engines
    finally:
        for proc in [router, *engines]:
            proc.stop(grace=5)
