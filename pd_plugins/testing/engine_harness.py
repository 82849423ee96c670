"""Start and stop real vLLM servers (prefill, decode, aggregated) for tests and the demo.

Each server gets its own HTTP and NIXL side-channel ports on 127.0.0.1 and its own CPU core
(VLLM_CPU_OMP_THREADS_BIND), logs to a file, and runs in its own session so that `stop()` ends
exactly the process group it started, by PID, even when a test fails.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from pd_plugins.testing.processes import LIVE_SERVERS, ManagedProcess, free_port  # noqa: F401
from pd_plugins.transfer.private_dir import private_dir

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


def nixl_config(role: str, mode: str = "pull", **extra: Any) -> dict[str, Any]:
    """A --kv-transfer-config for PdNixlConnector; role is "prefill", "decode" or "both"."""
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[role]
    return {
        "kv_connector": "PdNixlConnector",
        "kv_role": kv_role,
        "kv_buffer_device": DEVICE,
        "kv_connector_extra_config": {"mode": mode, **extra},
    }


KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def shm_config(role: str, pool_path: str, **extra: Any) -> dict[str, Any]:
    """A --kv-transfer-config for PdShmConnector on the pool at `pool_path` (removed when the
    last engine on it exits, so an interrupted run leaves no pool in /dev/shm's memory)."""
    return {
        "kv_connector": "PdShmConnector",
        "kv_role": KV_ROLES[role],
        "kv_connector_extra_config": {"pool_path": pool_path, "pool_size_gb": 0.25,
                                      "remove_when_unused": True, **extra},
    }


def lmcache_config(role: str, backend: str, **extra: Any) -> dict[str, Any]:
    """A --kv-transfer-config for PdLMCacheConnector on `backend` (see LMCacheOptions)."""
    return {
        "kv_connector": "PdLMCacheConnector",
        "kv_role": KV_ROLES[role],
        "kv_connector_extra_config": {"backend": backend, "local_cpu_gb": 0.25, **extra},
    }


@dataclass
class VllmServer(ManagedProcess):
    name: str
    model: Path
    cpu: str  # value for VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "1"
    kv_transfer_config: dict[str, Any] | None = None
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    side_channel_port: int = field(default_factory=free_port)
    served_model_name: str = "tiny"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "pd_plugins.launcher", "serve", str(self.model),
               "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", self.served_model_name, *COMMON_SERVER_ARGS,
               *DEVICE_SERVER_ARGS[DEVICE], *self.extra_args]
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
        # Its engine core's IPC sockets (VLLM_RPC_BASE_PATH) and its torch rendezvous file
        # (vllm_dist_*, in the temporary directory): a killed server would leave both in /tmp for
        # good. Both go in a directory of its own, removed when it stops. What lives in the
        # temporary directory for the whole host stays there: torch's compile cache (hundreds of
        # MB, built once) and pd-plugins' private directory (the per-host peer secret).
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_dir())
        env.setdefault("PD_PRIVATE_DIR", private_dir())
        scratch = str(self.scratch_dir())
        env.update({"VLLM_RPC_BASE_PATH": scratch, "TMPDIR": scratch})
        extra = (self.kv_transfer_config or {}).get("kv_connector_extra_config") or {}
        if extra.get("expert_signatures"):  # the capture hooks the V1 model runner (on a GPU
            env["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # with Triton, vLLM's default is V2)
        env.update(self.env)
        return env

    def metrics(self) -> str:
        return requests.get(f"{self.url}/metrics", timeout=10).text


def _inductor_cache_dir() -> str:
    """Where torch keeps its compile cache by default (torch/_inductor/runtime/
    cache_dir_utils.py: default_cache_dir), from this process's temporary directory."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (containers)
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def metric_value(metrics_text: str, name: str) -> float:
    """Sum of all samples of `name` (any labels) in Prometheus text; 0 when absent."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def start_all(servers: list[ManagedProcess], timeout: float = 600.0) -> list[ManagedProcess]:
    """Start servers together, wait for all; stop them all if any fails to come up.

    A vLLM server is healthy in about 25 s, but a clean-clone CI run once saw one take over 5
    minutes (3 of them spawning its worker) on a busy host: the limit is generous on purpose."""
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
