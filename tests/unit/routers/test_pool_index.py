"""The router sees shared KV pools: their blocks count as cached on every worker on the pool.

A shared-memory pool is read directly (a real pool here); an LMCache pool is learned from the
prefills' answers (LearnedPoolView)."""

import hashlib
import os

import numpy as np
import pytest

from pd_plugins.routers.config import WorkerSpec
from pd_plugins.routers.policy.deciders import UncachedLengthDecider, UncachedLengthParams
from pd_plugins.routers.policy.pool_index import LearnedPoolView, PoolPrefixView
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
    spec = WorkerSpec(url="http://127.0.0.1:8000", kv_pool="/dev/shm/pool")
    assert spec.kv_pool == "/dev/shm/pool"


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


def test_learned_pool_is_bounded_oldest_first():
    view = LearnedPoolView("lmcache:x", capacity_blocks=3)
    view.record([1, 2, 3])
    view.record([1])  # touched: now the newest
    view.record([4])  # drops 2, the oldest
    assert view.matched_blocks([1]) == 1
    assert view.matched_blocks([2]) == 0
    assert view.matched_blocks([3, 4, 1]) == 3
