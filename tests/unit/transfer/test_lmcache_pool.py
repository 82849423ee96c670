"""LMCachePool (transfer/lmcache_pool.py) against real LMCache backends on CPU.

The KV caches are real torch tensors in vLLM's CPU layout ([blocks, heads, block_size, 2*head]),
3 layers of random float32. A chunk is 2 blocks (32 tokens). Shared backends (fs, lm, redis) are
read back by a second process with another PYTHONHASHSEED; redis-server and the LMCache server
run on their own loopback ports and are stopped by PID in finalizers.

Run as `python -m tests.unit.transfer.test_lmcache_pool read|keys ...` this file is also the
other process (see `main`).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pd_plugins.testing.kv_servers import REDIS_SERVER, LMCacheServer, RedisServer
from pd_plugins.testing.processes import free_port
from pd_plugins.transfer.lmcache_pool import LMCachePool, parse_backend

REPO = Path(__file__).resolve().parents[3]
LAYERS, BLOCKS, HEADS, BS, HS2 = 3, 32, 2, 16, 16
CHUNK = 32
LAYOUT = "tiny-llama|float32|bs16|L3|tp1"
GEOMETRY = dict(num_layers=LAYERS, block_size=BS, chunk_size=CHUNK, kv_dtype=torch.float32,
                layer_block_shape=(HEADS, BS, HS2), local_cpu_gb=0.02, timeout_s=3.0)
TOKENS = [1000 + 7 * i for i in range(3 * CHUNK + 9)]  # 3 full chunks and a tail
FULL = 3 * CHUNK
SRC_BLOCKS = [3, 9, 4, 17, 8, 2, 30]  # covers all 105 tokens
DST_BLOCKS = [20, 21, 5, 6, 25, 26, 27]
SKIP = BS                              # the destination already holds block 0 itself
REDIS_OK = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed "
                              "(apt-get install redis-server): redis backend tests skipped")


def kv(seed: int | None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(BLOCKS, HEADS, BS, HS2) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(BLOCKS, HEADS, BS, HS2, generator=gen) for _ in range(LAYERS)]


def open_pool(backend: str, instance_id: str, layers=None, layout: str = LAYOUT, **kw):
    pool = LMCachePool(backend, layout=layout, instance_id=instance_id, **{**GEOMETRY, **kw})
    if layers is not None:
        pool.attach_kv(layers, BLOCKS)
    return pool


def assert_loaded(src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
    """Blocks 1..5 of the prompt arrived bit-exact; block 0 (skipped) and all others untouched."""
    moved = dict(zip(DST_BLOCKS[1:FULL // BS], SRC_BLOCKS[1:FULL // BS]))
    for s, d in zip(src, dst):
        for block in range(BLOCKS):
            if block in moved:
                assert torch.equal(d[block], s[moved[block]]), f"block {block} differs"
            else:
                assert not d[block].any(), f"block {block} was written"


@pytest.fixture(scope="module")
def redis_server():
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer()
    try:
        yield server.start().wait_healthy()
    finally:
        server.stop(grace=5)


@pytest.fixture(scope="module")
def lm_server():
    server = LMCacheServer()
    try:
        yield server.start().wait_healthy(120)
    finally:
        server.stop(grace=5)


@pytest.fixture
def own_server(request):
    """A server for one test, which the test may kill or stop (SIGSTOP)."""
    if request.param == "redis" and REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer() if request.param == "redis" else LMCacheServer()
    try:
        server.start().wait_healthy(120)
        url = server.redis_url if request.param == "redis" else server.lm_url
        yield server, url
    finally:
        server.kill(signal.SIGCONT)
        server.stop(grace=5)


def run_here(args: list[str], seed: str, timeout: float = 300) -> dict:
    """This file's `main` in a fresh interpreter with PYTHONHASHSEED=seed; its JSON answer.

    A child that hangs dumps its threads' stacks and exits before the test's timeout, so a
    failure says where it hung (a loaded CI host once needed over 120 s for one read)."""
    env = {**os.environ, "PYTHONHASHSEED": seed, "PD_TEST_DUMP_AFTER_S": str(timeout - 20)}
    proc = subprocess.run([sys.executable, "-m", "tests.unit.transfer.test_lmcache_pool", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- process-local backends --------------------------------------------------------------------
def test_cpu_round_trip_between_pools_sharing_an_engine():
    src, dst = kv(1), kv(None)
    worker = open_pool("cpu", "cpu-engine", src)
    scheduler = open_pool("cpu", "cpu-engine")         # no KV: lookups only, same engine
    other = open_pool("cpu", "cpu-other-engine")        # its own engine: shares nothing
    try:
        assert scheduler.lookup(TOKENS) == 0
        assert worker.store(TOKENS, SRC_BLOCKS) == FULL
        assert worker.store(TOKENS, SRC_BLOCKS) == 0      # chunks present are not stored again
        assert scheduler.lookup(TOKENS) == FULL
        assert scheduler.lookup(TOKENS[:CHUNK] + [1] + TOKENS[CHUNK + 1:]) == CHUNK
        assert other.lookup(TOKENS) == 0
        reader = open_pool("cpu", "cpu-engine", dst)    # another engine's KV, same pool engine
        assert reader.retrieve(TOKENS, DST_BLOCKS, skip_tokens=SKIP) == FULL
        assert_loaded(src, dst)
        assert reader.stats.retrieved_tokens == FULL - SKIP
        assert worker.stats.stored_tokens == FULL
        assert worker.stats.stored_bytes == LAYERS * (FULL // BS) * HEADS * BS * HS2 * 4
        reader.close()
    finally:
        for pool in (worker, scheduler, other):
            pool.close()


def test_disk_round_trip_reads_chunks_back_from_disk(tmp_path):
    src, dst = kv(2), kv(None)
    writer = open_pool(f"disk://{tmp_path}", "disk-engine", src)
    reader = open_pool(f"disk://{tmp_path}", "disk-engine", dst)
    try:
        assert writer.store(TOKENS, SRC_BLOCKS) == FULL
        # written asynchronously: wait until the disk backend has indexed every chunk (a chunk's
        # file can appear before it is indexed, and a lookup then stops short of it)
        engine = writer._shared.engine
        deadline = time.monotonic() + 10
        while engine.lookup(TOKENS, search_range=["LocalDiskBackend"]) < FULL:
            assert time.monotonic() < deadline, list(tmp_path.rglob("*"))
            time.sleep(0.02)
        assert len(list(tmp_path.rglob("*.pt"))) == FULL // CHUNK
        # drop the CPU copies (white box): what is read next can only come from disk
        engine.clear(locations=["LocalCPUBackend"])
        assert reader.lookup(TOKENS) == FULL
        assert reader.retrieve(TOKENS, DST_BLOCKS, skip_tokens=SKIP) == FULL
        assert_loaded(src, dst)
    finally:
        writer.close()
        reader.close()


def test_flash_layout_block_dim_1_round_trip():
    """vLLM's flash-attention layout [2, blocks, block_size, heads, head]: block dimension 1."""
    shape = (2, BLOCKS, BS, HEADS, HS2 // 2)
    src, dst = [torch.rand(shape) for _ in range(LAYERS)], [torch.zeros(shape) for _ in range(LAYERS)]
    geometry = dict(layer_block_shape=(2, BS, HEADS, HS2 // 2))
    writer = open_pool("cpu", "flash", src, **geometry)
    reader = open_pool("cpu", "flash", dst, **geometry)
    try:
        assert writer.store(TOKENS, SRC_BLOCKS) == FULL
        assert reader.retrieve(TOKENS, DST_BLOCKS, skip_tokens=SKIP) == FULL
        assert_loaded([t.movedim(1, 0) for t in src], [t.movedim(1, 0) for t in dst])
    finally:
        writer.close()
        reader.close()


def test_backend_strings():
    assert parse_backend("fs:///srv/kv")[0] == {"remote_url": "fs://localhost:0/srv/kv"}
    assert parse_backend("redis://127.0.0.1:6379/2")[1] == ("127.0.0.1", 6379)
    for bad in ("", "mem", "disk://relative", "fs://host/x", "lm://host", "lm://h:1/0",
                "redis://h:1/db", "s3://bucket"):
        with pytest.raises(ValueError, match="accepted: cpu, disk:///abs/path"):
            parse_backend(bad)


def test_same_instance_id_with_another_layout_is_refused():
    pool = open_pool("cpu", "refuse")
    try:
        with pytest.raises(ValueError, match="already open"):
            open_pool("cpu", "refuse", layout="other-model|bf16|bs16|L3|tp1")
    finally:
        pool.close()


# -- shared backends, read back by another process --------------------------------------------
def shared_backend(name: str, request, tmp_path) -> str:
    if name == "fs":
        return f"fs://{tmp_path}"
    if name == "lm":
        return request.getfixturevalue("lm_server").lm_url
    return request.getfixturevalue("redis_server").redis_url  # with a /0 database path


@pytest.mark.processes  # tests/tiers.py
@pytest.mark.parametrize("name", ["fs", "lm", pytest.param("redis", marks=REDIS_OK)])
def test_round_trip_across_processes(name, request, tmp_path):
    backend, src = shared_backend(name, request, tmp_path), kv(3)
    writer = open_pool(backend, f"writer-{name}", src)
    try:
        assert writer.store(TOKENS, SRC_BLOCKS) == FULL
        assert writer.store(TOKENS, SRC_BLOCKS) == 0
        out = tmp_path / "dst.pt"
        seed = "4242" if os.environ.get("PYTHONHASHSEED") != "4242" else "4243"
        got = run_here(["read", backend, str(out)], seed)
    finally:
        writer.close()
    assert got["hash_probe"] != hash("pd-hash-probe")  # the reader's str hashes differ from ours
    assert got["lookup"] == FULL and got["lookup_changed_chunk_2"] == 2 * CHUNK
    assert got["retrieved"] == FULL
    assert_loaded(src, torch.load(out))


def test_another_layout_never_hits(tmp_path):
    """Same tokens, same shared directory, another engine layout: no hit (same layout: hit)."""
    writer = open_pool(f"fs://{tmp_path}", "layout-a", kv(4))
    other = open_pool(f"fs://{tmp_path}", "layout-b", layout="tiny-llama|bfloat16|bs16|L3|tp1")
    same = open_pool(f"fs://{tmp_path}", "layout-a-again")
    try:
        assert writer.store(TOKENS, SRC_BLOCKS) == FULL
        assert other.lookup(TOKENS) == 0
        assert same.lookup(TOKENS) == FULL
    finally:
        for pool in (writer, other, same):
            pool.close()


@pytest.mark.processes  # tests/tiers.py
def test_chunk_keys_do_not_depend_on_python_hash_seed():
    """LMCache's keys do, with its default hash (Python's hash()) and even with sha256_cbor: its
    root hash comes from vLLM's NONE_HASH, seeded with the PYTHONHASHSEED string. The pool's
    keys agree between processes with different seeds."""
    with ThreadPoolExecutor(2) as pool:
        keys = list(pool.map(lambda seed: run_here(["keys"], seed), ("1", "2")))
    assert keys[0]["pool"] == keys[1]["pool"]
    for algorithm in ("builtin", "sha256_cbor"):
        assert keys[0][algorithm] != keys[1][algorithm]


# -- failures ---------------------------------------------------------------------------------
def assert_zeros_quickly(pool: LMCachePool, caplog, limit: float = 4.0) -> None:
    new = [5000 + i for i in range(FULL)]
    for call in (lambda: pool.lookup(new), lambda: pool.store(new, SRC_BLOCKS),
                 lambda: pool.retrieve(new, DST_BLOCKS)):
        start = time.monotonic()
        assert call() == 0
        assert time.monotonic() - start < limit
    assert any(r.name == "pd_plugins.transfer.lmcache_pool" and r.levelno == logging.WARNING
               for r in caplog.records), caplog.text


@pytest.mark.parametrize("scheme", ["lm", pytest.param("redis", marks=REDIS_OK)])
def test_backend_never_up(scheme, caplog):
    caplog.set_level(logging.WARNING, logger="pd_plugins.transfer.lmcache_pool")
    pool = open_pool(f"{scheme}://127.0.0.1:{free_port()}", f"never-{scheme}", kv(5))
    try:
        assert_zeros_quickly(pool, caplog)
        assert pool.stats.lookup_errors and pool.stats.store_errors
    finally:
        pool.close()


@pytest.mark.processes  # tests/tiers.py
@pytest.mark.parametrize("own_server", ["lm", pytest.param("redis", marks=REDIS_OK)],
                         indirect=True)
def test_backend_killed(own_server, caplog):
    caplog.set_level(logging.WARNING, logger="pd_plugins.transfer.lmcache_pool")
    server, url = own_server
    pool = open_pool(url, f"killed-{server.name}", kv(6))
    try:
        assert pool.store(TOKENS, SRC_BLOCKS) == FULL
        server.kill(signal.SIGKILL)
        server.proc.wait(5)
        time.sleep(1.1)  # past the pool's cached "reachable" answer
        assert_zeros_quickly(pool, caplog)
        assert pool.lookup(TOKENS) == FULL  # what this process holds itself stays usable
    finally:
        pool.close()


@pytest.mark.processes  # tests/tiers.py
@pytest.mark.parametrize("own_server", ["lm"], indirect=True)
def test_hung_server_costs_one_timeout_then_fails_fast(own_server, caplog):
    """A stopped (not dead) lm server: LMCache blocks on its socket with no timeout."""
    server, url = own_server
    pool = open_pool(url, "hung", kv(7), timeout_s=2.0)
    try:
        assert pool.store(TOKENS, SRC_BLOCKS) == FULL
        server.kill(signal.SIGSTOP)
        start = time.monotonic()
        assert pool.lookup([9000 + i for i in range(FULL)]) == 0
        assert 1.5 < time.monotonic() - start < 3.5
        start = time.monotonic()
        assert pool.retrieve(TOKENS, DST_BLOCKS) == 0  # the stuck call blocks the engine: fail fast
        assert time.monotonic() - start < 0.5
        assert "still stuck" in caplog.text
    finally:
        server.kill(signal.SIGKILL)  # lets LMCache's blocked event loop go before closing
        pool.close()


@pytest.mark.processes  # tests/tiers.py
@REDIS_OK
def test_close_with_redis_returns(redis_server):
    """LMCache's own close deadlocks on redis; the pool's must not, nor may process exit."""
    got = run_here(["close", f"redis://127.0.0.1:{redis_server.port}"], "0", timeout=90)
    assert got["close_seconds"] < 2.0  # LMCache's deadlock defused, not just timed out


# -- the other process ------------------------------------------------------------------------
def main(argv: list[str]) -> None:
    faulthandler.dump_traceback_later(float(os.environ.get("PD_TEST_DUMP_AFTER_S", 280)), exit=True)
    answer: dict = {"hash_probe": hash("pd-hash-probe")}
    if argv[0] == "read":  # read back what the test stored, into a zeroed KV cache
        backend, out = argv[1], argv[2]
        dst = kv(None)
        pool = open_pool(backend, "reader", dst)
        changed = TOKENS[:2 * CHUNK] + [1] + TOKENS[2 * CHUNK + 1:]
        answer.update(lookup=pool.lookup(TOKENS), lookup_changed_chunk_2=pool.lookup(changed),
                      retrieved=pool.retrieve(TOKENS, DST_BLOCKS, skip_tokens=SKIP))
        torch.save(dst, out)
        pool.close()
    elif argv[0] == "keys":  # chunk keys: the pool's, and LMCache's own
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.token_database import ChunkedTokenDatabase

        pool = open_pool("cpu", "keys")
        database = pool._shared.engine.token_database
        answer["pool"] = [k.chunk_hash for _, _, k in database.process_tokens(TOKENS)]
        for algorithm in ("builtin", "sha256_cbor"):
            config = LMCacheEngineConfig.from_dict({"chunk_size": CHUNK,
                                                    "pre_caching_hash_algorithm": algorithm})
            theirs = ChunkedTokenDatabase(config, database.metadata)
            answer[algorithm] = [k.chunk_hash for _, _, k in theirs.process_tokens(TOKENS)]
        pool.close()
    elif argv[0] == "close":  # close one pool, leave another open for the exit hook
        first = open_pool(argv[1], "close-a", kv(8))
        first.store(TOKENS, SRC_BLOCKS)
        start = time.monotonic()
        first.close()
        answer["close_seconds"] = time.monotonic() - start
        open_pool(argv[1], "close-b", kv(9)).store([7] * FULL, SRC_BLOCKS)
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])


def test_namespaces_keep_requests_apart(tmp_path):
    """Chunks stored under a namespace (a request's salt, LoRA, multimodal inputs) are found
    only under the same namespace, on the engine's own tier and through a shared one."""
    salted, other = "a1" * 16, "b2" * 16
    src, dst = kv(4), kv(None)
    writer = open_pool(f"fs://{tmp_path}", "ns-writer", src)
    reader = open_pool(f"fs://{tmp_path}", "ns-reader", dst)   # another engine on the pool
    try:
        assert writer.store(TOKENS, SRC_BLOCKS, namespace=salted) == FULL
        for pool in (writer, reader):
            assert pool.lookup(TOKENS) == 0                       # no namespace: not the same KV
            assert pool.lookup(TOKENS, namespace=other) == 0
            assert pool.lookup(TOKENS, namespace=salted) == FULL
        assert reader.retrieve(TOKENS, DST_BLOCKS, skip_tokens=SKIP, namespace=other) == SKIP
        assert not any(t.any() for t in dst)                      # nothing written
        assert writer.store(TOKENS, SRC_BLOCKS) == FULL           # unsalted: stored anew
        assert reader.retrieve(TOKENS, DST_BLOCKS, skip_tokens=SKIP, namespace=salted) == FULL
        assert_loaded(src, dst)
    finally:
        writer.close()
        reader.close()
