"""GPU lane, SGLang case (`make test-gpu`, docs/gpu.md): real SGLang servers on CUDA, KV in GPU
memory moved by pd-plugins' `pd-nixl` backend (NIXL registers it as VRAM), through pd-router.

A prefill and a decode server (`--disaggregation-transfer-backend pd-nixl`, pull and push) and an
aggregated server of the same model share one GPU; greedy answers through pd-router must equal
the aggregated server's token for token. The decode never computes the prompt, so a KV that did
not travel (or landed in the wrong pages) shows as a different answer.

Runs only with PD_TEST_DEVICE=cuda, a visible GPU and SGLang's CUDA build (.venv-gpu-sglang,
made by scripts/test_gpu.sh); anywhere else the module is skipped before importing SGLang.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field

import pytest

if os.environ.get("PD_TEST_DEVICE") != "cuda":
    pytest.skip("GPU lane only (PD_TEST_DEVICE=cuda, make test-gpu)", allow_module_level=True)
if not os.environ.get("PD_GPU_MODEL"):
    pytest.skip("set PD_GPU_MODEL to a local model folder", allow_module_level=True)
import requests  # noqa: E402
import sglang.srt.entrypoints.http_server  # noqa: E402, F401  (the lane fails, not skips, without it)

from pd_plugins.testing.engine_harness import start_all  # noqa: E402
from pd_plugins.testing.processes import ManagedProcess, free_port  # noqa: E402
from pd_plugins.testing.router_harness import RouterProcess  # noqa: E402

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("PD_GPU_MODEL", "")
# Three servers on one GPU: each takes this share of its memory for weights and KV.
MEM_FRACTION = os.environ.get("PD_GPU_SGLANG_MEM_FRACTION", "0.2")
DTYPE = os.environ.get("PD_GPU_SGLANG_DTYPE", "bfloat16")
SERVED_NAME = "pd-test"  # pd-router checks a request's model against the workers' /v1/models
EXTRA_ARGS = shlex.split(os.environ.get("PD_GPU_SGLANG_ARGS", ""))  # e.g. an --attention-backend
PROMPTS = ["The capital of France is", "Write a haiku about the sea:",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "List three prime numbers greater than 100:" * 20]


@dataclass
class SglangServer(ManagedProcess):
    name: str
    mode: str | None = None            # prefill | decode | None (aggregated)
    transfer_mode: str = "pull"        # PD_NIXL_MODE
    bootstrap_port: int = field(default_factory=free_port)

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", MODEL,
               "--served-model-name", SERVED_NAME, "--device", "cuda",
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", DTYPE,
               "--mem-fraction-static", MEM_FRACTION, "--random-seed", "0", *EXTRA_ARGS]
        if self.mode is not None:
            cmd += ["--disaggregation-mode", self.mode,
                    "--disaggregation-transfer-backend", "pd-nixl"]
            if self.mode == "prefill":
                cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        return cmd

    def environment(self) -> dict[str, str]:
        return {**os.environ, "SGLANG_PLUGINS": "pd_plugins", "PD_NIXL_MODE": self.transfer_mode,
                "HF_HUB_OFFLINE": "1",
                # network interfaces only (as the vLLM lane): GPU memory goes by UCX's CUDA transports
                "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}


def complete(url: str, prompt: str) -> str:
    answer = requests.post(f"{url}/v1/completions", timeout=300, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0})
    assert answer.status_code == 200, answer.text[:500]
    return answer.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def aggregated(tmp_path_factory):
    """The aggregated server's answers (it stops before the PD servers start)."""
    server = SglangServer("sglang-aggregated", log_dir=tmp_path_factory.mktemp("aggregated"))
    start_all([server], timeout=900)
    try:
        return {prompt: complete(server.url, prompt) for prompt in PROMPTS}
    finally:
        server.stop()


@pytest.mark.parametrize("transfer_mode", ["pull", "push"])
def test_pd_nixl_on_cuda_equals_aggregated(aggregated, transfer_mode, tmp_path):
    prefill = SglangServer("sglang-prefill", mode="prefill", transfer_mode=transfer_mode,
                           log_dir=tmp_path)
    decode = SglangServer("sglang-decode", mode="decode", transfer_mode=transfer_mode,
                          log_dir=tmp_path)
    router = RouterProcess("router", prefill=[[prefill.url, f"bootstrap_port={prefill.bootstrap_port}"]],
                           decode=[[decode.url]], args=("--engine", "sglang"), log_dir=tmp_path)
    # one after the other: each sizes its KV pool from the GPU memory free when it starts
    servers = start_all([prefill], timeout=900)
    try:
        servers += start_all([decode], timeout=900)
        router.start()
        router.wait_healthy(60)
        for prompt in PROMPTS:
            assert complete(router.url, prompt) == aggregated[prompt], prompt
    finally:
        for server in [router, *servers]:
            server.stop()
