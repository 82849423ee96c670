"""The shared-memory KV pool on a real /dev/shm mapping, within one process and across several."""

import hashlib
import os
import time

import numpy as np
import pytest

from pd_plugins.transfer.shm_pool import (
    FORMAT_VERSION, PinnedSlots, PoolError, ShmKVPool, SlotRef, SlotRefs, checksum,
    checksums_by_default, pool_geometry, remove_pool,
)

SLOT = 4096


@pytest.fixture
def pool_path(tmp_path):
    path = f"/dev/shm/pd-test-pool-{os.getpid()}-{tmp_path.name}"
    yield path
    remove_pool(path)


def open_pool(path, size=64 * SLOT, **kw):
    return ShmKVPool(path, slot_bytes=SLOT, layout="test-layout", size_bytes=size, **kw)


def key_of(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def block(i: int, nbytes: int = SLOT) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, nbytes, dtype=np.uint8)


def put(pool, i, hold_s=0.0):
    (ref,) = pool.reserve([key_of(i)])
    assert ref is not None
    data = block(i)
    chk = pool.write(ref, data)
    assert pool.publish([(ref, chk, data.nbytes)], hold_s=hold_s) == [True]
    return ref


def get(pool, i):
    (pinned,) = pool.pin([key_of(i)])
    if pinned is None:
        return None
    out = pool.read(pinned).copy()
    assert pool.unpin([pinned]) == [True]
    assert checksum(out) == pinned.checksum
    return out


def test_geometry_fits_the_region():
    slot, n, offset = pool_geometry(1 << 20, 1000)
    assert slot % 64 == 0 and slot >= 1000 and n > 0
    assert offset % 4096 == 0 and offset + n * slot <= 1 << 20


def test_round_trip_and_second_process_view(pool_path):
    with open_pool(pool_path) as writer, open_pool(pool_path, create=False) as reader:
        put(writer, 1)
        assert np.array_equal(get(reader, 1), block(1))
        assert get(reader, 2) is None
        assert reader.count_prefix([key_of(1), key_of(2), key_of(1)]) == 1


def test_layout_mismatch_is_a_clear_error(pool_path):
    with open_pool(pool_path):
        with pytest.raises(PoolError, match="another KV layout"):
            ShmKVPool(pool_path, slot_bytes=SLOT, layout="other-model", size_bytes=64 * SLOT)
        with pytest.raises(PoolError, match="another KV layout"):
            ShmKVPool(pool_path, slot_bytes=2 * SLOT, layout="test-layout")


def test_not_a_pool_and_too_small(tmp_path):
    junk = tmp_path / "junk"
    junk.write_bytes(b"x" * 100_000)
    junk.chmod(0o600)  # trusted (test_shm_pool_trust.py covers untrusted files)
    with pytest.raises(PoolError, match="not a pd-plugins KV pool"):
        ShmKVPool(str(junk), slot_bytes=SLOT, layout="l", create=False)
    with pytest.raises(PoolError, match="too small"):
        ShmKVPool(str(tmp_path / "tiny"), slot_bytes=SLOT, layout="l", size_bytes=SLOT)


def test_published_blocks_are_not_written_twice(pool_path):
    with open_pool(pool_path) as pool:
        put(pool, 1)
        assert pool.reserve([key_of(1), key_of(2)])[0] is None  # already there
        # a key being written by a live writer is not reserved again either
        assert pool.reserve([key_of(2)]) == [None]


def test_lru_eviction_spares_held_and_pinned_slots(pool_path):
    with open_pool(pool_path, size=16 * SLOT) as pool:
        n = pool.num_slots
        held = put(pool, 0, hold_s=60)
        put(pool, 1)
        (pinned,) = pool.pin([key_of(1)])
        for i in range(2, 2 + 3 * n):  # churn through the pool several times
            put(pool, i)
        assert get(pool, 0) is not None and np.array_equal(pool.read(pinned), block(1))
        assert pool.unpin([pinned]) == [True]
        assert get(pool, 2) is None  # old unheld, unpinned blocks went first
        pool.release_hold([held])
        for i in range(10_000, 10_000 + n):
            put(pool, i)
        assert get(pool, 0) is None and get(pool, 1) is None


def test_extend_hold_keeps_a_block_a_writer_found_already_published(pool_path):
    """A writer that finds its prompt's blocks already published (stored earlier, their hold
    over) holds them for its decode as it would hold blocks it wrote: eviction takes the unheld
    ones and spares them. A hold is never shortened, and a ref whose slot was reused since is
    not held."""
    with open_pool(pool_path, size=16 * SLOT) as pool:
        n = pool.num_slots
        put(pool, 0)  # stored earlier, no hold
        gone = put(pool, 1)  # likewise, and not held again
        long_held = put(pool, 2, hold_s=600)
        found = pool.lookup([key_of(0), key_of(99), key_of(2)])  # the writer's lookup
        assert pool.extend_hold(found, 60) == [True, False, True]
        assert pool._cols["hold_until"][long_held.slot] > time.time() + 500  # not shortened
        for i in range(3, 3 + 3 * n):  # other writers churn through the pool
            put(pool, i)
        assert np.array_equal(get(pool, 0), block(0))
        assert get(pool, 1) is None  # the unheld one was evicted
        assert pool.extend_hold([gone], 60) == [False]  # its slot holds another block now
        assert pool.extend_hold([], 60) == []


def test_full_pool_reserves_nothing(pool_path):
    with open_pool(pool_path, size=16 * SLOT) as pool:
        for i in range(pool.num_slots):
            put(pool, i, hold_s=60)
        assert pool.reserve([key_of(-1)]) == [None]
        assert pool.stats().held == pool.num_slots


def test_unpublished_slots_are_invisible_and_abandon_frees(pool_path):
    with open_pool(pool_path) as pool:
        (ref,) = pool.reserve([key_of(5)])
        pool.write(ref, block(5))
        assert pool.pin([key_of(5)]) == [None]  # written but not published
        pool.abandon([ref])
        assert pool.stats().writing == 0


def test_expired_write_lease_cannot_publish(pool_path):
    with open_pool(pool_path, size=8 * SLOT) as pool:
        (slow,) = pool.reserve([key_of(1)], write_lease_s=0.05)
        time.sleep(0.1)
        refs = pool.reserve([key_of(i) for i in range(100, 100 + pool.num_slots)])
        assert any(r is not None and r.slot == slow.slot for r in refs)  # taken over
        assert pool.publish([(slow, 0, SLOT)]) == [False]


def test_hint_is_used_only_for_the_same_key(pool_path):
    with open_pool(pool_path) as pool:
        a, b = put(pool, 1), put(pool, 2)
        (p,) = pool.pin([key_of(1)], hints=[b])  # a hint pointing at another key's slot
        assert p.slot == a.slot
        (p2,) = pool.pin([key_of(3)], hints=[a])
        assert p2 is None
        (p3,) = pool.pin([key_of(1)], hints=[SlotRef(10**9, 1)])  # out of range: ignored
        assert p3.slot == a.slot
        pool.unpin([p, p3])


def test_a_reader_whose_lease_ran_out_learns_its_copy_is_void(pool_path):
    with open_pool(pool_path, size=8 * SLOT) as pool:
        put(pool, 1)
        (p,) = pool.pin([key_of(1)], read_lease_s=0.05)
        time.sleep(0.1)
        for i in range(100, 100 + 2 * pool.num_slots):
            put(pool, i)
        assert pool.unpin([p]) == [False]


def test_checksum_sees_a_changed_word():
    data = block(7)
    tampered = data.copy()
    tampered[100] ^= 1
    assert checksum(data) != checksum(tampered)
    assert checksum(np.arange(13, dtype=np.uint8)) != checksum(np.arange(1, 14, dtype=np.uint8))


def test_attach_takes_the_pools_own_layout(pool_path):
    with open_pool(pool_path) as pool:
        put(pool, 3)
        with ShmKVPool.attach(pool_path) as view:
            assert view.layout == "test-layout" and view.slot_bytes == SLOT
            assert view.pool_id == pool.pool_id
            assert np.array_equal(get(view, 3), block(3))
    with pytest.raises(ValueError):
        ShmKVPool(pool_path, slot_bytes=None, layout=None)  # attach never creates


def test_batched_copies_and_the_pools_checksum_setting(pool_path):
    rows = np.stack([block(i) for i in range(6)])
    with open_pool(pool_path) as pool:
        refs = pool.reserve([key_of(i) for i in range(6)])
        assert [r.slot for r in refs] == list(range(refs[0].slot, refs[0].slot + 6))  # one run
        sums = pool.write_many(refs, rows)
        assert [int(s) for s in sums] == [checksum(r) for r in rows]
        pool.publish([(r, s, SLOT) for r, s in zip(refs, sums)])
        pins = pool.pin([key_of(i) for i in range(6)])
        out = np.zeros_like(rows)
        assert pool.read_many(pins, out) == [True] * 6 and np.array_equal(out, rows)
        pool.data[pins[2].slot, 7] ^= 1  # a stray write
        assert pool.read_many(pins, out) == [True, True, False, True, True, True]
        pool.unpin(pins)


def test_a_pool_without_checksums_says_so_to_every_opener(tmp_path):
    path = f"/dev/shm/pd-test-plain-{os.getpid()}-{tmp_path.name}"
    try:
        with ShmKVPool(path, slot_bytes=SLOT, layout="l", size_bytes=16 * SLOT,
                       checksums=False) as pool:
            assert not pool.checksums
            with ShmKVPool(path, slot_bytes=SLOT, layout="l", checksums=True) as other:
                assert not other.checksums  # the pool's setting wins
            (ref,) = pool.reserve([key_of(1)])
            assert pool.write(ref, block(1)) == 0
    finally:
        remove_pool(path)


def test_the_array_calls_move_a_batch_without_per_block_objects(pool_path):
    """reserve and pin hand back arrays that write_many, publish_many, read_many and unpin take
    as they are; a key already published comes back as slot -1 (None when indexed)."""
    rows = np.stack([block(i) for i in range(5)])
    with open_pool(pool_path) as pool:
        put(pool, 2)
        refs = pool.reserve([key_of(i) for i in range(5)])
        assert isinstance(refs, SlotRefs) and refs[2] is None and refs.slots[2] == -1
        todo = refs.present()
        assert len(todo) == 4 and [r.slot for r in todo] == todo.slots.tolist()
        sums = pool.write_many(todo, rows[[0, 1, 3, 4]])
        assert pool.publish_many(todo, sums, SLOT).tolist() == [True] * 4
        assert pool.publish_many(todo, sums, SLOT).tolist() == [False] * 4  # published already
        assert pool.lookup([key_of(i) for i in range(6)]).slots[5] == -1
        assert pool.count_prefix([key_of(i) for i in (0, 1, 2, 3, 9, 4)]) == 4
        pins = pool.pin([key_of(i) for i in (4, 9, 0)], hints=pool.lookup([key_of(4)]))
        assert isinstance(pins, PinnedSlots) and pins[1] is None
        assert pins == [pins[0], None, pins[2]] and pins[0].checksum == checksum(rows[4])
        got = pins.present()
        out = np.zeros((2, SLOT), dtype=np.uint8)
        assert pool.read_many(got, out) == [True, True] and np.array_equal(out, rows[[4, 0]])
        assert pool.unpin(got) == [True, True] and pool.stats().pinned == 0


def test_hints_that_name_another_key_or_generation_are_not_followed(pool_path):
    with open_pool(pool_path) as pool:
        one, two = put(pool, 1), put(pool, 2)
        stale = SlotRef(one.slot, one.seq + 1)
        pins = pool.pin([key_of(1), key_of(2), key_of(3)], hints=[two, stale, SlotRef(10**9, 1)])
        assert [p.slot if p else None for p in pins] == [one.slot, two.slot, None]
        pool.unpin(pins.present())


def test_hints_out_of_the_pools_integer_range_are_ignored_not_fatal(pool_path):
    # hints come from a peer's kv_transfer_params (msgpack carries ints up to 2**64 - 1): one the
    # pool's int64 slot column cannot hold raised OverflowError in the decode worker, and vLLM
    # stops an engine whose start_load_kv raises
    with open_pool(pool_path) as pool:
        one = put(pool, 1)
        pins = pool.pin([key_of(1), key_of(2)],
                        hints=[SlotRef(1 << 63, one.seq), SlotRef(1 << 64, 1 << 64)])
        assert [p.slot if p else None for p in pins] == [one.slot, None]
        pool.unpin(pins.present())


def test_keys_must_be_32_bytes(pool_path):
    with open_pool(pool_path) as pool, pytest.raises(ValueError, match="32 bytes"):
        pool.reserve([b"short"])


def test_checksums_by_default_only_where_memory_may_not_be_coherent(pool_path, tmp_path):
    assert checksums_by_default("/dev/null")  # a character device, as a DAX device is
    assert not checksums_by_default(str(tmp_path))
    assert not checksums_by_default(pool_path)  # not there yet: a file will be created
    with open_pool(pool_path, checksums=None) as pool:
        assert not pool.checksums


def test_a_pool_of_another_format_version_is_refused(pool_path):
    with open_pool(pool_path) as pool:
        pool._super["version"] = FORMAT_VERSION - 1
    with pytest.raises(PoolError, match="format"):
        open_pool(pool_path)


def test_discard_drops_a_bad_slot_only_while_nobody_else_reads_it(pool_path):
    with open_pool(pool_path) as pool:
        put(pool, 1, hold_s=60)  # a prefill's hold does not keep a bad block
        (mine,) = pool.pin([key_of(1)])
        (theirs,) = pool.pin([key_of(1)])  # another reader copying the same slot
        pool.unpin([mine])
        assert pool.discard([mine]) == 0 and get(pool, 1) is not None
        pool.unpin([theirs])
        assert pool.discard([theirs]) == 1
        assert pool.lookup([key_of(1)]) == [None] and pool.count_prefix([key_of(1)]) == 0
        assert pool.discard([theirs]) == 0  # dropped once
        put(pool, 1)  # the key can be stored again, in a new generation
        (again,) = pool.pin([key_of(1)])
        pool.unpin([again])
        assert again.seq != theirs.seq and pool.discard([mine]) == 0  # an old pin drops nothing
        assert get(pool, 1) is not None
