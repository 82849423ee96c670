"""Real vLLM deployments for the end-to-end tests: aggregated references and PD pairs."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from pd_plugins.testing.engine_harness import (
    DEVICE,
    VllmServer,
    lmcache_config,
    metric_value,
    nixl_config,
    shm_config,
    start_all,
)
from pd_plugins.transfer.shm_pool import remove_pool
from pd_plugins.testing.pd_client import PrefillTarget, pd_legs, pd_push, prefill
from pd_plugins.testing.tiny_models import VOCAB_SIZE, ensure_tiny_model

MAX_TOKENS = 24
NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"  # counted by the side that initiates
PUSH_STALL_S = 45.0  # a push request not answered by then has stalled (see PdDeployment.legs)
PUSH_ATTEMPTS = 3
DEFAULT_TEST_LEASE_S = 120    # stalls come in runs when CI's host is loaded
FIRST_ORDINARY_TOKEN = 6  # ids below are special tokens

# Prompt lengths against block size 32: shorter than a block, block-aligned, two unaligned.
PROMPT_LENGTHS = (20, 64, 100, 150)


def token_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB_SIZE) for _ in range(length)]


PROMPTS = {n: token_prompt(n, seed=n) for n in PROMPT_LENGTHS}
# Swap test: same length, same last token, different history (see test_swap_*).
SWAP_A = token_prompt(80, seed=1001)
SWAP_B = token_prompt(79, seed=1002) + SWAP_A[-1:]
CONCURRENT = [token_prompt(40 + 11 * i, seed=2000 + i) for i in range(8)]
# Shared-memory pool (test_pd_shm): the pool holds full blocks only, so a swap that must give
# exactly A's output uses block-aligned prompts (the decode computes just the shared last token).
SHM_SWAP_A = token_prompt(64, seed=3001)
SHM_SWAP_B = token_prompt(63, seed=3002) + SHM_SWAP_A[-1:]
SHM_CORRUPT = token_prompt(70, seed=3003)
SHARED_PREFIX = token_prompt(96, seed=4001)  # three full blocks
PREFIX_TURNS = [SHARED_PREFIX + token_prompt(20 + 10 * i, seed=4002 + i) for i in range(2)]
# LMCache (test_pd_lmcache): one full 32-token chunk each and the same last token, so exchanging
# their single stored chunk swaps their KV.
LM_SWAP_A = token_prompt(33, seed=5001)
LM_SWAP_B = token_prompt(32, seed=5002) + LM_SWAP_A[-1:]
LM_BACKEND_DOWN = token_prompt(90, seed=5003)
ALL_PROMPTS = [*PROMPTS.values(), SWAP_A, SWAP_B, *CONCURRENT,
               SHM_SWAP_A, SHM_SWAP_B, SHM_CORRUPT, *PREFIX_TURNS,
               LM_SWAP_A, LM_SWAP_B, LM_BACKEND_DOWN]


def completion_body(prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def output_ids(resp: requests.Response) -> list[int]:
    assert resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text[:500]}"
    return resp.json()["choices"][0]["token_ids"]


# The GPU lane swaps the tiny models for real small models given by local path.
GPU_MODEL_ENV = {"tiny-llama": "PD_GPU_MODEL", "tiny-qwen3-moe": "PD_GPU_MOE_MODEL",
                 "tiny-mixtral": "PD_GPU_MIXTRAL_MODEL",
                 "tiny-gemma3": "PD_GPU_SWA_MODEL",  # sliding window + full (gemma-3-270m)
                 "tiny-granite4-hybrid": "PD_GPU_SSM_MODEL"}  # Mamba + attention (granite-4.0-h)



def model_available(name: str) -> bool:
    return DEVICE == "cpu" or bool(os.environ.get(GPU_MODEL_ENV[name]))


def model_path(name: str) -> Path:
    if DEVICE == "cpu":
        return ensure_tiny_model(name)
    if not model_available(name):
        pytest.skip(f"{GPU_MODEL_ENV[name]} is not set: no local model for {name} on {DEVICE}")
    return Path(os.environ[GPU_MODEL_ENV[name]])


def aggregated_references(model_names: list[str]) -> dict[str, dict[tuple[int, ...], list[int]]]:
    """Greedy outputs of plain (no connector) servers, one per model, pinned to separate cores."""
    servers = [
        VllmServer(f"aggregated-{name}", model_path(name), cpu=str(i % 2))
        for i, name in enumerate(model_names)
        if model_available(name)
    ]
    start_all(servers)
    try:
        return {
            server.name.removeprefix("aggregated-"): {
                tuple(p): output_ids(requests.post(f"{server.url}/v1/completions",
                                                   json=completion_body(p), timeout=120))
                for p in ALL_PROMPTS
            }
            for server in servers
        }
    finally:
        for server in servers:
            server.stop()


@dataclass(frozen=True)
class PdConfig:
    model: str = "tiny-llama"
    mode: str = "pull"
    prefix_caching: bool = True
    failure_policy: str = "fail"
    lease_seconds: int | None = None
    connector: str = "PdNixlConnector"  # or upstream's "NixlConnector", to compare
    num_blocks: int | None = None       # a small KV pool makes freed blocks come back fast
    extra: tuple[tuple[str, object], ...] = ()  # more kv_connector_extra_config
    prefill_tp: int = 1  # --tensor-parallel-size, one core per rank (TP_CORES)
    decode_tp: int = 1

    @property
    def id(self) -> str:
        cache = "cache" if self.prefix_caching else "nocache"
        upstream = "" if self.connector == "PdNixlConnector" else f"-{self.connector}"
        tp = "" if (self.prefill_tp, self.decode_tp) == (1, 1) else \
            f"-tp{self.prefill_tp}to{self.decode_tp}"
        return f"{self.model}-{self.mode}-{cache}-{self.failure_policy}{upstream}{tp}"


# VLLM_CPU_OMP_THREADS_BIND of a server by role and TP size ("|" separates the ranks' lists):
# prefill on core 0, decode on core 1, a TP 2 engine's two ranks on its one core. An idle TP 2
# vllm-cpu engine keeps both workers and their NIXL progress threads polling; spread over both
# cores they starved the other engine's startup for minutes (2026-12-04).
TP_CORES = {("prefill", 1): "0", ("decode", 1): "1", ("prefill", 2): "0|0", ("decode", 2): "1|1"}


def tp_args(tp: int) -> tuple[str, ...]:
    return () if tp == 1 else ("--tensor-parallel-size", str(tp))


# Push-mode and concurrent pull e2e tests run everywhere, CI included. Sessions 5-7 saw them stall
# on the 2-core CI host (push WRITEs and pull READs waiting until the prefill's lease ran out) and
# skipped them in CI. The cause was upstream's NIXL worker moving each engine's model thread to the
# last core, so both engines computed on one core (PdNixlConnector now keeps the engine's binding:
# keep_cpu_affinity). PD_TEST_PUSH=0 / PD_TEST_CONCURRENT_PULL=0 still switch them off.
PUSH_ENABLED = os.environ.get("PD_TEST_PUSH", "1") == "1"
CONCURRENT_PULL_ENABLED = os.environ.get("PD_TEST_CONCURRENT_PULL", "1") == "1"
# The whole matrix (`make test-full`): cells that repeat a behaviour another cell already proves in
# CI (same connector and mode on another model) run only here, to keep CI under its time budget.
FULL_MATRIX = os.environ.get("PD_TEST_FULL", "0") == "1"
# A test or cell that repeats a path CI already covers: it runs only in the full matrix.
FULL_MATRIX_ONLY = pytest.mark.skipif(not FULL_MATRIX, reason="full matrix only: PD_TEST_FULL=1 "
                                      "(make test-full)")


def skip_concurrent_pull_if_off(config: PdConfig) -> None:
    if config.mode == "pull" and not CONCURRENT_PULL_ENABLED:
        pytest.skip("concurrent pull switched off (PD_TEST_CONCURRENT_PULL=0)")


def pd_param(config: PdConfig, full_matrix_only: bool = False):
    """A PdConfig as a pytest parameter, skipped when push mode is switched off (PUSH_ENABLED);
    `full_matrix_only`: a cell that runs only in the full matrix (FULL_MATRIX)."""
    marks = [pytest.mark.skipif(config.mode == "push" and not PUSH_ENABLED,
                                reason="push e2e switched off (PD_TEST_PUSH=0)")]
    if full_matrix_only:
        marks.append(FULL_MATRIX_ONLY)
    return pytest.param(config, marks=marks, id=config.id)


@dataclass
class PdDeployment:
    config: PdConfig
    prefill: VllmServer
    decode: VllmServer
    target: PrefillTarget = field(init=False)

    def __post_init__(self) -> None:
        self.target = PrefillTarget(
            url=self.prefill.url,
            engine_id=self.prefill.kv_transfer_config["engine_id"],
            side_channel_port=self.prefill.side_channel_port,
            tp_size=self.config.prefill_tp,
        )

    def complete(self, body: dict[str, Any]) -> requests.Response:
        return self.legs(body)[1]

    def legs(self, body: dict[str, Any]) -> tuple[dict[str, Any], requests.Response]:
        """(prefill's kv_transfer_params, decode response) of one full PD request.

        Push mode: upstream NIXL push stalls about one request in twenty on a busy 2-core machine
        (neither leg ever answers; issue 10). Like pd-router, the test client then gives up after
        PUSH_STALL_S and retries with a fresh request id, PUSH_ATTEMPTS times in all.
        """
        if self.config.mode == "pull":
            return pd_legs("pull", self.target, self.decode.url, body)
        return self.push_legs(body)

    def push_legs(self, body: dict[str, Any], prefill_body: dict[str, Any] | None = None
                  ) -> tuple[dict[str, Any], requests.Response]:
        for _ in range(PUSH_ATTEMPTS - 1):
            try:
                return pd_push(self.target, self.decode.url, body, prefill_body, timeout=PUSH_STALL_S)
            except requests.Timeout:
                warnings.warn("push request stalled (upstream, issue 10); retrying")
        return pd_push(self.target, self.decode.url, body, prefill_body, timeout=PUSH_STALL_S)

    def prefill_only(self, body: dict[str, Any]) -> dict[str, Any]:
        """A prefill leg with no decode leg (pull mode only: see pd_client.pd_push)."""
        assert self.config.mode == "pull"
        return prefill(self.target, body)

    def stop(self) -> None:
        self.prefill.stop()
        self.decode.stop()

    @classmethod
    def start(cls, config: PdConfig) -> PdDeployment:
        model = model_path(config.model)
        extra: dict[str, Any] = dict(config.extra)
        # Longer than upstream's 30 s by default: on a slow CI host a decode once read later than
        # that, and PdNixlConnector's lease check rightly failed those reads (policy fail: 500).
        extra["kv_lease_duration"] = config.lease_seconds or DEFAULT_TEST_LEASE_S
        args = () if config.prefix_caching else ("--no-enable-prefix-caching",)
        if config.num_blocks is not None:
            args += ("--num-gpu-blocks-override", str(config.num_blocks))
        configs = {}
        for role in ("prefill", "decode"):
            kv = nixl_config(role, config.mode, **extra)
            kv["kv_connector"] = config.connector
            kv["kv_load_failure_policy"] = config.failure_policy
            kv["engine_id"] = f"{role}-{uuid.uuid4().hex[:8]}"
            configs[role] = kv
        prefill_server = VllmServer("prefill", model, TP_CORES["prefill", config.prefill_tp],
                                    configs["prefill"], args + tp_args(config.prefill_tp))
        decode_server = VllmServer("decode", model, TP_CORES["decode", config.decode_tp],
                                   configs["decode"], args + tp_args(config.decode_tp))
        deployment = cls(config, prefill_server, decode_server)
        try:
            start_all([prefill_server, decode_server])
            deployment.warm_up()
        except BaseException:  # a pair that failed to come up must not outlive the test run
            deployment.stop()  # (a CI run once left two busy vLLM servers behind)
            raise
        return deployment

    def warm_up(self, attempts: int = 3) -> None:
        """Establish the NIXL handshakes before tests measure anything.

        On a loaded 2-core machine the very first handshake of a fresh pair can miss its timeout
        (push: the prefill's handshake to the decode was seen to take 28 s; pull: the side-channel
        reply comes too late, and with kv_load_failure_policy=fail that request fails). A warm-up
        counts once a request went through without a failed load (PdNixlConnector counts them;
        a push that missed its deadline is recomputed and would look fine otherwise).
        """
        for _ in range(attempts):
            failed_before = self.failed_loads()
            try:
                ok = self.complete(completion_body(token_prompt(40, seed=7))).status_code == 200
            except requests.RequestException:  # a stalled first handshake; the next one works
                ok = False
            if ok and self.failed_loads() == failed_before:
                return

    def transfers(self) -> float:
        """NIXL transfers so far, counted by the reader: decode in pull mode, prefill in push."""
        return sum(metric_value(server.metrics(), NIXL_TRANSFERS)
                   for server in (self.prefill, self.decode))

    def transfers_above(self, before: float, timeout_s: float = 20) -> bool:
        """Wait until more than `before` transfers are counted. vLLM hands a transfer's stats
        to /metrics with a later step's outputs (a clean-clone CI run read a push prefill's
        counter before it moved)."""
        deadline = time.monotonic() + timeout_s
        while self.transfers() <= before and time.monotonic() < deadline:
            time.sleep(0.5)
        return self.transfers() > before

    def failed_loads(self) -> float:
        metrics = self.decode.metrics()
        return sum(metric_value(metrics, f"vllm:pd_nixl_{name}_total")
                   for name in ("recomputes", "failed_loads"))


class DeploymentPool:
    """At most one live PD pair (two servers) at a time; reused while tests ask for the same one."""

    def __init__(self) -> None:
        self.current: PdDeployment | None = None

    def get(self, config: PdConfig) -> PdDeployment:
        if self.current is not None and self.current.config == config:
            return self.current
        self.close()
        self.current = PdDeployment.start(config)
        return self.current

    def discard(self) -> None:
        """Drop the current pair (a test broke it on purpose)."""
        self.close()

    def close(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


POOL_CONNECTORS = {"PdShmConnector": "shm", "PdLMCacheConnector": "lmcache"}


def pool_loaded_blocks(server: VllmServer, connector: str) -> float:
    """Blocks a pool connector's engine loaded from its pool (summed over its ranks)."""
    metrics = server.metrics()
    if connector == "shm":
        return metric_value(metrics, "vllm:pd_shm_loaded_blocks_total")
    return metric_value(metrics, "vllm:pd_lmcache_retrieved_tokens_total") / 32  # tokens/block


@contextlib.contextmanager
def pool_pair(connector: str, model: str, prefill_tp: int = 1, decode_tp: int = 1,
              **extra: Any) -> Iterator[tuple[VllmServer, VllmServer]]:
    """A prefill and a decode of a pool connector ("shm": PdShmConnector on a shared-memory pool
    of their own; "lmcache": PdLMCacheConnector on an fs:// directory of their own), policy
    `fail`, `extra` options, started together; both stopped and the pool removed afterwards."""
    name = f"pd-e2e-{uuid.uuid4().hex[:10]}"
    if connector == "shm":
        path = f"/dev/shm/{name}"
        kv_config = partial(shm_config, pool_path=path)
        cleanup = partial(remove_pool, path)
    else:
        directory = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        # one 32-token chunk per block, as the harness's --block-size
        kv_config = partial(lmcache_config, backend=f"fs://{directory}", chunk_size=32)
        cleanup = partial(shutil.rmtree, directory, ignore_errors=True)

    def server(role: str, tp: int) -> VllmServer:
        kv = kv_config(role, **extra)
        kv["kv_load_failure_policy"] = "fail"
        return VllmServer(f"{connector}-{role}", model_path(model), TP_CORES[role, tp], kv,
                          tp_args(tp))

    servers = (server("prefill", prefill_tp), server("decode", decode_tp))
    try:
        start_all(list(servers))
        yield servers
    finally:
        for s in servers:
            s.stop()
        cleanup()
