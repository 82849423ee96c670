"""Start and stop real vLLM servers (prefill, decode, aggregated) for tests and the demo.

Each server gets its own HTTP and NIXL side-channel ports on 127.0.0.1 and its own CPU core
(VLLM_CPU_OMP_THREADS_BIND), logs to a file, and runs in its own session so that `stop()` ends
exactly the process group it started, by PID, even when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

LIVE_SERVERS: list[VllmServer] = []  # for log dumps on test failure

# "cpu" (vllm-cpu, the default) or "cuda" (the GPU lane, `make test-gpu`).
DEVICE = os.environ.get("PD_TEST_DEVICE", "cpu")

COMMON_SERVER_ARGS = (
    "--enforce-eager",
    "--max-model-len", "512",
    "--max-num-seqs", "8",
    "--block-size", "32",  # CPU attention: a multiple of 32
    "--seed", "0",
)
DEVICE_SERVER_ARGS = {
    "cpu": ("--dtype", "float32"),
    # Several servers share one GPU in the lane.
    "cuda": ("--dtype", os.environ.get("PD_GPU_DTYPE", "float32"),
             "--gpu-memory-utilization", os.environ.get("PD_GPU_MEMORY_UTILIZATION", "0.25")),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nixl_config(role: str, mode: str = "pull", **extra: Any) -> dict[str, Any]:
    """A --kv-transfer-config for PdNixlConnector; role is "prefill", "decode" or "both"."""
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[role]
    return {
        "kv_connector": "PdNixlConnector",
        "kv_role": kv_role,
        "kv_buffer_device": DEVICE,
        "kv_connector_extra_config": {"mode": mode, **extra},
    }


@dataclass
class VllmServer:
    name: str
    model: Path
    cpu: str  # value for VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "1"
    kv_transfer_config: dict[str, Any] | None = None
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    side_channel_port: int = field(default_factory=free_port)
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pd-vllm-")))
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "pd_plugins.launcher", "serve", str(self.model),
               "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", "tiny", *COMMON_SERVER_ARGS, *DEVICE_SERVER_ARGS[DEVICE],
               *self.extra_args]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if DEVICE == "cpu":
            env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": self.cpu})
        env.update({
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
            "UCX_NET_DEVICES": "lo",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONHASHSEED": "0",
            "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"),
        })
        env.update(self.env)
        return env

    def start(self) -> VllmServer:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
            start_new_session=True,
        )
        log.close()
        LIVE_SERVERS.append(self)
        return self

    def wait_healthy(self, timeout: float = 240.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's whole process group (engine core included)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 15.0) -> None:
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self.kill(signal.SIGKILL)  # children outliving the leader
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self in LIVE_SERVERS:
            LIVE_SERVERS.remove(self)

    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def metrics(self) -> str:
        return requests.get(f"{self.url}/metrics", timeout=10).text

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def metric_value(metrics_text: str, name: str) -> float:
    """Sum of all samples of `name` (any labels) in Prometheus text; 0 when absent."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def start_all(servers: list[VllmServer], timeout: float = 300.0) -> list[VllmServer]:
    """Start servers together, wait for all; stop them all if any fails to come up."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_healthy(timeout)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
