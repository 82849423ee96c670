"""LMCacheMPClient against a real `lmcache server` (MP mode, KV over POSIX shm) on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from pd_plugins.testing.lmcache_mp_server import LMCacheMPServer
from pd_plugins.testing.processes import free_port
from pd_plugins.transfer.lmcache_mp import (
    SHM_DIR, SHM_PREFIX, LMCacheMPClient, _locked, remove_dead_kv_segments,
)

pytestmark = pytest.mark.processes  # an `lmcache server` and client subprocesses (tests/tiers.py)

LAYERS, BLOCKS, HEADS, BS, HS2 = 3, 32, 2, 16, 16  # vLLM CPU layout [blocks, heads, bs, 2*hs]
CHUNK = 16
GEOMETRY = dict(num_layers=LAYERS, block_size=BS, chunk_size=CHUNK, kv_dtype=torch.float32,
                layer_block_shape=(HEADS, BS, HS2))
LAYOUT = "tiny-llama|float32|bs16|L3|tp1"
TOKENS = [1000 + 7 * i for i in range(74)]  # 4 full chunks + 10 tokens
SRC_BLOCKS = [3, 4, 5, 6, 7]


def own_segments() -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{SHM_PREFIX}{os.getpid()}_")]


def test_segments_of_dead_processes_are_removed_and_live_ones_kept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    paths = {pid: os.path.join(SHM_DIR, f"{SHM_PREFIX}{pid}_0") for pid in (dead.pid, os.getpid())}
    for path in paths.values():
        with open(path, "wb") as f:
            f.write(b"kv")
    try:
        assert remove_dead_kv_segments() >= 1
        assert not os.path.exists(paths[dead.pid])
        assert os.path.exists(paths[os.getpid()])  # a live process's segment is never touched
    finally:
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)


def test_a_locked_segment_of_a_pid_dead_here_is_kept_until_its_holder_dies():
    """Containers of one pod share /dev/shm but not PIDs: a segment named with a pid that no
    process here has is another container's while its owner (any namespace) holds the lock."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that names no process here, as another namespace's would
    path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{dead.pid}_0")
    with open(path, "wb") as f:
        f.write(b"kv")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({path!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_SH)\n"
        "print('held', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        remove_dead_kv_segments()
        assert os.path.exists(path)  # its owner lives (elsewhere): kept
        holder.kill()
        holder.wait()
        assert remove_dead_kv_segments() >= 1 and not os.path.exists(path)  # the lock went with it
    finally:
        holder.kill()
        holder.wait()
        if os.path.exists(path):
            os.unlink(path)


def zeros() -> list[torch.Tensor]:
    return [torch.zeros(BLOCKS, HEADS, BS, HS2) for _ in range(LAYERS)]


def start_server() -> LMCacheMPServer:
    server = LMCacheMPServer()
    try:
        server.start().wait_healthy(180)
    except BaseException:
        server.stop(grace=5)
        raise
    return server


@pytest.fixture
def server():
    srv = start_server()
    try:
        yield srv
    finally:
        srv.stop(grace=10)


STORER = textwrap.dedent("""
    import json, sys, torch
    from pd_plugins.transfer.lmcache_mp import LMCacheMPClient
    url, layout, out, tokens, blocks = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5])
    torch.manual_seed(7)
    layers = [torch.randn({blocks_}, {heads}, {bs}, {hs2}) for _ in range({layers_})]
    client = LMCacheMPClient(url, layout=layout, num_layers={layers_}, block_size={bs},
                             chunk_size={chunk}, kv_dtype=torch.float32,
                             layer_block_shape=({heads}, {bs}, {hs2}), timeout_s=10.0)
    client.attach_kv(layers, {blocks_})
    stored = client.store(tokens, blocks)
    torch.save([t.clone() for t in layers], out)
    print(json.dumps(dict(stored=stored, stats=client.stats, pid_hash_seed=__import__('os').environ.get('PYTHONHASHSEED'))))
    client.close()
""").format(blocks_=BLOCKS, heads=HEADS, bs=BS, hs2=HS2, layers_=LAYERS, chunk=CHUNK)


def store_in_subprocess(url: str, layout: str, tmp_path, tokens=TOKENS, blocks=SRC_BLOCKS):
    out = tmp_path / f"src-{layout.replace('|', '_')}.pt"
    env = dict(os.environ, PYTHONHASHSEED="4242")  # not the test process's hash seed
    proc = subprocess.run([sys.executable, "-c", STORER, url, layout, str(out), json.dumps(tokens),
                           json.dumps(blocks)], capture_output=True, text=True, timeout=120,
                          env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                              os.path.dirname(os.path.abspath(__file__))))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result, torch.load(out)


def test_store_in_other_process_then_retrieve_bit_exact(server, tmp_path):
    result, src = store_in_subprocess(server.mp_url, LAYOUT, tmp_path)
    assert result["stored"] == 64 and result["pid_hash_seed"] == "4242"
    assert result["stats"]["stored_bytes"] == 4 * LAYERS * HEADS * BS * HS2 * 4

    # worker-side client (attaches KV) and scheduler-side client (lookups only), one process
    dst = zeros()
    worker = LMCacheMPClient(server.mp_url, layout=LAYOUT, **GEOMETRY)
    sched = LMCacheMPClient(server.mp_url, layout=LAYOUT, **GEOMETRY)
    try:
        worker.attach_kv(dst, BLOCKS)
        assert sched.lookup(TOKENS) == 64
        assert sched.lookup(TOKENS[:40]) == 32
        assert sched.lookup(TOKENS[:15]) == 0
        assert sched.lookup([1] + TOKENS[1:]) == 0  # first chunk differs: no prefix
        assert worker.lookup(TOKENS + [5] * 40) == 64

        # skip_tokens=16: block 20 (tokens 0..15) must stay untouched
        got = worker.retrieve(TOKENS, [20, 21, 22, 23, 24], skip_tokens=16)
        assert got == 64
        for layer in range(LAYERS):
            assert torch.count_nonzero(dst[layer][20]) == 0
            assert torch.equal(dst[layer][21:24], src[layer][4:7])
        assert worker.stats["retrieved_tokens"] == 48

        # full retrieve into other blocks: bit-exact, nothing else written
        assert worker.retrieve(TOKENS, [10, 11, 12, 13, 14]) == 64
        for layer in range(LAYERS):
            assert torch.equal(dst[layer][10:14].view(torch.int32), src[layer][3:7].view(torch.int32))
            touched = torch.zeros(BLOCKS, dtype=torch.bool)
            touched[[10, 11, 12, 13, 21, 22, 23]] = True
            assert torch.count_nonzero(dst[layer][~touched]) == 0
        # a prefix that is present only partly: the present leading chunks
        assert worker.retrieve(TOKENS[:32] + [9] * 32, [25, 26, 27, 28]) == 32
        assert torch.equal(dst[0][25:27], src[0][3:5])
        assert worker.stats["retrieved_tokens"] == 48 + 64 + 32
        assert sched.stats["lookup_errors"] == 0
        assert own_segments(), "LMCache moved the attached KV into /dev/shm"
        assert all(_locked(os.path.join(SHM_DIR, n)) for n in own_segments())  # held while alive
    finally:
        worker.close()
        sched.close()
    assert own_segments() == [] and worker._segment_locks == {}  # unlinked at close: an engine's KV never outlives it there


def test_server_down_answers_zero_quickly(tmp_path):
    def check_all_zero(client: LMCacheMPClient, kv: list[torch.Tensor]) -> None:
        for _ in range(3):
            for op in (lambda: client.lookup(TOKENS), lambda: client.store(TOKENS, SRC_BLOCKS),
                       lambda: client.retrieve(TOKENS, [20, 21, 22, 23, 24])):
                t0 = time.monotonic()
                assert op() == 0
                assert time.monotonic() - t0 < 3.0
        assert all(torch.count_nonzero(t[20:25]) == 0 for t in kv)

    # nothing listening at all
    kv = zeros()
    never = LMCacheMPClient(f"mp://127.0.0.1:{free_port()}", layout=LAYOUT, timeout_s=1.0, **GEOMETRY)
    t0 = time.monotonic()
    never.attach_kv(kv, BLOCKS)
    assert time.monotonic() - t0 < 3.0
    check_all_zero(never, kv)
    assert never.stats["lookup_errors"] >= 3
    t0 = time.monotonic()
    never.close()
    assert time.monotonic() - t0 < 3.0

    # a server that dies while clients are attached, then comes back on the same port
    srv = start_server()
    client = None
    try:
        kv = zeros()
        kv[0][3:8] = 1.5
        client = LMCacheMPClient(srv.mp_url, layout=LAYOUT, timeout_s=1.0, **GEOMETRY)
        client.attach_kv(kv, BLOCKS)
        assert client.store(TOKENS, SRC_BLOCKS) == 64
        srv.kill()  # SIGKILL: no goodbye
        srv.proc.wait(timeout=10)
        check_all_zero(client, kv)

        srv2 = LMCacheMPServer(port=srv.port)
        srv = srv2
        srv.start().wait_healthy(180)
        deadline = time.monotonic() + 30
        stored = 0
        while time.monotonic() < deadline and not stored:  # the client re-probes, re-registers
            stored = client.store(TOKENS, SRC_BLOCKS)
            time.sleep(0.2)
        assert stored == 64
        assert client.lookup(TOKENS) == 64
        assert client.retrieve(TOKENS, [20, 21, 22, 23, 24]) == 64
        assert torch.equal(kv[0][20:24], kv[0][3:7])
    finally:
        if client is not None:
            t0 = time.monotonic()
            client.close()
            assert time.monotonic() - t0 < 3.0
        srv.stop(grace=10)


def test_different_layout_never_hits(server, tmp_path):
    result, src = store_in_subprocess(server.mp_url, LAYOUT, tmp_path)
    assert result["stored"] == 64
    other = LAYOUT.replace("tp1", "tp1|other-model")
    dst = zeros()
    worker = LMCacheMPClient(server.mp_url, layout=other, **GEOMETRY)
    try:
        worker.attach_kv(dst, BLOCKS)
        assert worker.lookup(TOKENS) == 0
        assert worker.retrieve(TOKENS, [20, 21, 22, 23, 24]) == 0
        assert all(torch.count_nonzero(t) == 0 for t in dst)
        # the same tokens stored under the other layout stay separate from the first one's
        for t in dst:
            t[20:24] = 2.0
        assert worker.store(TOKENS, [20, 21, 22, 23]) == 64
        assert worker.lookup(TOKENS) == 64
        dst_same = zeros()
        same = LMCacheMPClient(server.mp_url, layout=LAYOUT, **GEOMETRY)
        try:
            same.attach_kv(dst_same, BLOCKS)
            assert same.retrieve(TOKENS, [1, 2, 3, 4]) == 64
            assert all(torch.equal(d[1:5], s[3:7]) for d, s in zip(dst_same, src))
            assert worker.retrieve(TOKENS, [8, 9, 10, 11]) == 64
            assert all(torch.all(d[8:12] == 2.0) for d in dst)
        finally:
            same.close()
    finally:
        worker.close()


def test_namespaces_keep_requests_apart_on_the_server(server):
    """A namespace (a request's salt, LoRA, multimodal inputs) is the server's cache salt:
    chunks stored under one are found only under the same one."""
    salted, other = "a1" * 16, "b2" * 16
    src = zeros()
    for t in src:
        t[20:24] = 3.0
    worker = LMCacheMPClient(server.mp_url, layout=LAYOUT, **GEOMETRY)
    try:
        worker.attach_kv(src, BLOCKS)
        assert worker.store(TOKENS, [20, 21, 22, 23], namespace=salted) == 64
        assert worker.lookup(TOKENS, namespace=salted) == 64
        assert worker.lookup(TOKENS) == 0
        assert worker.lookup(TOKENS, namespace=other) == 0
        assert worker.retrieve(TOKENS, [10, 11, 12, 13], namespace=other) == 0
        assert all(torch.count_nonzero(t[10:14]) == 0 for t in src)
        assert worker.retrieve(TOKENS, [10, 11, 12, 13], namespace=salted) == 64
        assert all(torch.all(t[10:14] == 3.0) for t in src)
    finally:
        worker.close()


def test_a_handshake_answer_that_is_no_chunk_size_disables_the_client_not_the_engine():
    # LMCache's client resolves a reply without a payload (a broken server, or another program
    # on the port) to None: int(None) raised out of lookup(), in vLLM's scheduler
    class NoPayload:  # stands in for the handshake's future (named as such: its answer is the test)
        def result(self, timeout=None):
            return None

        def query(self):
            return True

    client = LMCacheMPClient(f"mp://127.0.0.1:{free_port()}", layout=LAYOUT, timeout_s=1.0,
                             **GEOMETRY)
    try:
        client._probe = NoPayload()
        assert client.lookup(TOKENS) == 0 and client.lookup(TOKENS) == 0
        assert not client._usable  # disabled, as for a chunk size that does not match
    finally:
        client.close()
