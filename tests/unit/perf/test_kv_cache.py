"""The KV cache model: prefix hits, bounded capacity, LRU eviction of unpinned blocks only."""

from pd_plugins.perf.kv_cache import KvCache


def test_prefix_hit_and_release_keeps_blocks_cached():
    cache = KvCache(10)
    assert cache.try_allocate([1, 2, 3], private_blocks=1) == 0
    assert cache.used_blocks == 4
    cache.release([1, 2, 3], 1)
    assert cache.used_blocks == 3 and cache.cached_blocks == 3
    assert cache.try_allocate([1, 2, 9], private_blocks=0) == 2  # shares the first two blocks


def test_full_cache_refuses_until_released_and_never_evicts_pinned_blocks():
    stored, removed = [], []
    cache = KvCache(4, on_stored=stored.extend, on_removed=removed.extend)
    assert cache.try_allocate([1, 2, 3], 1) == 0
    assert cache.try_allocate([7], 0) is None  # all four blocks pinned
    assert cache.used_blocks == 4 and removed == []
    cache.release([1, 2, 3], 1)
    assert cache.try_allocate([7, 8], 0) == 0
    assert removed == [1] and stored == [1, 2, 3, 7, 8]  # least recently used first


def test_lru_order_follows_use():
    removed = []
    cache = KvCache(3, on_removed=removed.extend)
    for keys in ([1], [2], [3]):
        cache.try_allocate(keys, 0)
        cache.release(keys, 0)
    cache.try_allocate([1], 0)  # touch 1: now 2 is the oldest
    cache.release([1], 0)
    cache.try_allocate([4], 0)
    assert removed == [2]


def test_allocation_never_evicts_its_own_prefix():
    removed = []
    cache = KvCache(3, on_removed=removed.extend)
    cache.try_allocate([1, 2], 0)
    cache.release([1, 2], 0)
    assert cache.try_allocate([1, 2, 3], 0) == 2
    assert removed == []
    cache.release([1, 2, 3], 0)
    assert cache.try_allocate([1, 5, 6, 7], 0) is None  # would have to evict block 1 itself


def test_in_use_counts_pinned_and_private_blocks_but_not_the_evictable_cache():
    cache = KvCache(10)
    cache.try_allocate([1, 2], 1)
    cache.try_allocate([1, 3], 0)  # block 1 pinned twice
    assert cache.in_use_blocks == 4 and cache.used_blocks == 4
    cache.release([1, 2], 1)
    assert cache.in_use_blocks == 2  # 1 (still pinned by the second) and 3
    cache.release([1, 3], 0)
    assert cache.in_use_blocks == 0 and cache.used_blocks == 3


def test_insert_cached_adds_unpinned_blocks_while_there_is_room():
    stored = []
    cache = KvCache(4, on_stored=stored.extend)
    cache.try_allocate([1, 2], 1)
    cache.release([1, 2], 1)
    cache.insert_cached([3, 4, 5])  # room for two more
    assert stored == [1, 2, 3, 4] and cache.in_use_blocks == 0 and cache.match([1, 2, 3, 4]) == 4


def test_host_tier_keeps_blocks_the_device_evicted_in_its_own_lru():
    removed = []
    cache = KvCache(2, on_removed=removed.extend, host_capacity_blocks=3)
    for keys in ([1, 2], [3, 4]):
        assert cache.try_allocate(keys, 0) == 0
        cache.release(keys, 0)
    assert removed == [1, 2] and cache.match([1, 2, 3]) == 0  # gone from the device
    # every block was written through; the host tier's budget (3) dropped its oldest, 1
    assert cache.host_blocks == 3
    assert cache.match_host([1, 2, 3], 0) == 0
    assert cache.match_host([1, 2, 3, 4], 1) == 3  # found from the first block the device lacks
    assert cache.try_allocate([5], 0) == 0  # the device evicts 3; the host tier writes 5 ...
    assert cache.match_host([2], 0) == 0    # ... and drops its least recently used, 2
    assert cache.match_host([3, 4, 5], 0) == 3


def test_without_a_host_tier_nothing_is_found_there():
    cache = KvCache(1)
    cache.try_allocate([1], 0)
    cache.release([1], 0)
    cache.try_allocate([2], 0)
    assert cache.match_host([1], 0) == 0 and cache.host_blocks == 0


def test_a_device_hit_keeps_its_host_copy_fresh():
    cache = KvCache(2, host_capacity_blocks=2)
    for key in (1, 2):
        cache.try_allocate([key], 0)
        cache.release([key], 0)
    assert cache.match_host([1], cache.match([1])) == 0  # on the device: nothing to load; touched
    cache.try_allocate([3], 0)  # the device evicts 1, the host tier its least recent copy, 2
    assert cache.match([1]) == 0 and cache.match_host([1], 0) == 1
    assert cache.match_host([2], 0) == 0
