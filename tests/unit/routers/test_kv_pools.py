"""The router sees shared KV pools: their blocks count as cached on every worker on the pool.

A shared-memory pool is read directly (a real pool here); an LMCache pool is learned from the
prefills' answers (LearnedPoolView)."""

import hashlib
import subprocess
import sys
import os

import numpy as np
import pytest

from pd_plugins.routers.config import WorkerSpec
from pd_plugins.routers.kv_sources.pools import LearnedPoolView, PoolPrefixView, pool_view
from pd_plugins.routers.policy.deciders import UncachedLengthDecider, UncachedLengthParams
from pd_plugins.routers.policy.prefix import PrefixCacheScorer
from pd_plugins.transfer.shm_pool import ShmKVPool, remove_pool
from tests.unit.routers.helpers import BLOCK, context, request

PROMPT = list(range(100, 100 + 6 * BLOCK))


@pytest.fixture
def kv_pool(tmp_path):
    path = f"/dev/shm/pd-router-pool-{os.getpid()}-{tmp_path.name}"
    pool = ShmKVPool(path, slot_bytes=64, layout="router-test", size_bytes=1 << 20)
    yield pool
    pool.close()
    remove_pool(path)


def publish(pool: ShmKVPool, content_keys: list[int]) -> None:
    """What PdShmConnector does for a prefill: one slot per block, with the router's key."""
    keys = [hashlib.sha256(str(k).encode()).digest() for k in content_keys]
    refs = pool.reserve(keys, content_keys)
    data = np.zeros(64, dtype=np.uint8)
    pool.publish([(ref, pool.write(ref, data), 64) for ref in refs])


def test_view_counts_leading_blocks_and_refreshes(kv_pool):
    keys = request(PROMPT).block_keys
    view = PoolPrefixView(kv_pool.path, refresh_s=0.0)
    assert view.matched_blocks(keys) == 0
    publish(kv_pool, keys[:4])
    assert view.matched_blocks(keys) == 4
    publish(kv_pool, keys[5:])  # a gap: only the leading run counts
    assert view.matched_blocks(keys) == 4
    view.close()


def test_view_of_a_pool_not_created_yet_matches_nothing(tmp_path):
    view = PoolPrefixView(str(tmp_path / "no-pool-yet"), refresh_s=0.0)
    assert view.matched_blocks([1, 2, 3]) == 0


def test_pool_members_all_hold_the_pooled_prefix(kv_pool):
    ctx = context(prefills=2, decodes=2)
    view = PoolPrefixView(kv_pool.path, refresh_s=0.0)
    prefills, decodes = ctx.pool.by_role("prefill"), ctx.pool.by_role("decode")
    for worker in [prefills[0], *decodes]:  # prefill 1 is on another host: no pool
        ctx.prefix_index.attach_pool(worker.url, view)
    info = request(PROMPT)
    publish(kv_pool, info.block_keys)
    assert PrefixCacheScorer(ctx).score(info, prefills) == [1.0, 0.0]
    # both decodes hold it: the decode choice no longer depends on where the prefill ran
    assert PrefixCacheScorer(ctx).score(info, decodes) == [1.0, 1.0]
    # the whole prompt is in the pool: no need for a prefill leg at all
    decider = UncachedLengthDecider(UncachedLengthParams(min_uncached_tokens=BLOCK), ctx)
    assert decider.disaggregate(info, decodes[1], prefills)[0] is False
    ctx.prefix_index.forget_worker(decodes[0].url)
    assert PrefixCacheScorer(ctx).score(info, decodes) == [0.0, 1.0]


def test_worker_spec_takes_a_pool_path():
    spec = WorkerSpec(url="http://127.0.0.1:8000", kv_pool="/dev/shm/pool", kv_pool_group="kv")
    assert spec.kv_pool == "/dev/shm/pool" and spec.kv_pool_group == "kv"


def test_view_reads_a_group_shared_pool_only_when_told_the_group(tmp_path):
    path = f"/dev/shm/pd-router-group-{os.getpid()}-{tmp_path.name}"
    gid = os.getgid()
    try:
        with ShmKVPool(path, slot_bytes=64, layout="router-test", size_bytes=1 << 20,
                       group=gid) as pool:  # 0660: the engines' pool_group
            publish(pool, [1])
            assert PoolPrefixView(path, refresh_s=0.0).matched_blocks([1]) == 0  # refused
            assert PoolPrefixView(path, refresh_s=0.0, group=gid).matched_blocks([1]) == 1
    finally:
        remove_pool(path)


def test_learned_pool_counts_what_prefills_reported_storing():
    ctx = context(prefills=1, decodes=2)
    view = LearnedPoolView("lmcache:redis-1")
    prefill, decodes = ctx.pool.by_role("prefill")[0], ctx.pool.by_role("decode")
    for worker in [prefill, *decodes]:
        ctx.prefix_index.attach_pool(worker.url, view)
    info = request(PROMPT)
    assert PrefixCacheScorer(ctx).score(info, decodes) == [0.0, 0.0]
    # the prefill stored 4 of the prompt's 6 blocks (full LMCache chunks only)
    ctx.prefix_index.record_stored_in_pool(prefill.url, info.block_keys[:4])
    assert ctx.prefix_index.matched_blocks(decodes[1].url, info.block_keys) == 4
    assert PrefixCacheScorer(ctx).score(info, decodes) == [4 / 6, 4 / 6]
    # a worker not on the pool learns nothing from it
    ctx.prefix_index.forget_worker(decodes[0].url)
    assert ctx.prefix_index.matched_blocks(decodes[0].url, info.block_keys) == 0


def test_the_worker_option_names_the_kind_of_pool(tmp_path):
    learned = pool_view("lmcache:redis-1")
    assert isinstance(learned, LearnedPoolView) and learned.name == "lmcache:redis-1"
    shm = pool_view(str(tmp_path / "pool"), group=1234)
    assert isinstance(shm, PoolPrefixView) and (shm.path, shm.group) == (str(tmp_path / "pool"), 1234)


def test_learned_pool_is_bounded_oldest_first():
    view = LearnedPoolView("lmcache:x", capacity_blocks=3)
    view.record([1, 2, 3])
    view.record([1])  # touched: now the newest
    view.record([4])  # drops 2, the oldest
    assert view.matched_blocks([1]) == 1
    assert view.matched_blocks([2]) == 0
    assert view.matched_blocks([3, 4, 1]) == 3


def _mapping_perms(path: str) -> list[str]:
    ino = str(os.stat(path).st_ino)
    with open("/proc/self/maps") as f:
        return [fields[1] for fields in map(str.split, f) if len(fields) >= 5
                and fields[4] == ino]


def test_view_maps_the_pool_read_only(kv_pool):
    view = PoolPrefixView(kv_pool.path, refresh_s=0.0)
    publish(kv_pool, [1, 2])
    assert view.matched_blocks([1, 2, 3]) == 2
    perms = _mapping_perms(kv_pool.path)
    assert sorted(perms) == ["r--s", "rw-s"]  # the view's, and the engine-side handle's
    view.close()


def test_view_of_an_unfit_pool_matches_nothing_and_recovers(tmp_path):
    """A truncated (or planted, or corrupt) pool file is an unknown pool, never an exception
    into the request path (before: a ValueError on every refresh, answered 500); once an engine
    makes a good pool at the path, the view reads it."""
    path = f"/dev/shm/pd-router-unfit-{os.getpid()}-{tmp_path.name}"
    try:
        ShmKVPool(path, slot_bytes=64, layout="router-test", size_bytes=1 << 20).close()
        os.truncate(path, 1 << 19)
        view = PoolPrefixView(path, refresh_s=0.0)
        assert view.matched_blocks([1, 2]) == 0
        assert view.matched_blocks([1, 2]) == 0  # and again: no state left half-made
        os.unlink(path)
        with ShmKVPool(path, slot_bytes=64, layout="router-test", size_bytes=1 << 20) as pool:
            publish(pool, [1, 2])
            assert view.matched_blocks([1, 2]) == 2
        view.close()
    finally:
        remove_pool(path)


def test_view_follows_a_pool_that_was_removed_and_made_again(tmp_path):
    path = f"/dev/shm/pd-router-remade-{os.getpid()}-{tmp_path.name}"
    try:
        view = PoolPrefixView(path, refresh_s=0.0)
        with ShmKVPool(path, slot_bytes=64, layout="router-test", size_bytes=1 << 20) as pool:
            publish(pool, [1, 2])
        assert view.matched_blocks([1, 2]) == 2
        remove_pool(path)  # pd-pool remove: the old file's keys are no engine's any more
        assert view.matched_blocks([1, 2]) == 0
        with ShmKVPool(path, slot_bytes=64, layout="router-test", size_bytes=1 << 20) as pool:
            publish(pool, [1])
            assert view.matched_blocks([1, 2]) == 1
        view.close()
    finally:
        remove_pool(path)


@pytest.mark.processes  # a fresh interpreter: this one has the pool's module loaded already
def test_a_router_without_a_shm_pool_does_not_load_the_pool_module():
    """The pool's module loads numba (its copy kernels): a router pays for it only with a shm
    pool configured, not at every startup (it had cost ~0.3 s and ~70 MiB of memory)."""
    code = ("import sys, pd_plugins.routers.cli, pd_plugins.routers.server, "
            "pd_plugins.routers.model_group; "
            "print(sorted(m for m in sys.modules if m == 'numba' or m.endswith('.shm_pool')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
