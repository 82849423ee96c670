"""A writer can never copy into or publish a slot it no longer owns: real processes on /dev/shm,
in a pool without checksums (the default for a file), where nothing else would catch it.

The pool is filled with held blocks but for one slot, so a second writer can only get the slot
whose reservation ran out: the case where a stalled writer's late copy used to land in another
writer's published block.
"""

import hashlib
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest

from pd_plugins.transfer.shm_pool import ShmKVPool, SlotRefs, remove_pool

SLOT = 4096
LEASE_S = 0.2
CTX = mp.get_context("fork")


def open_pool(path):
    return ShmKVPool(path, slot_bytes=SLOT, layout="fence-test", size_bytes=16 * SLOT,
                     checksums=False, prefault=False)


def key_of(i: int) -> bytes:
    return hashlib.sha256(b"fence%d" % i).digest()


def block(fill: int) -> np.ndarray:
    return np.full(SLOT, fill, dtype=np.uint8)


@pytest.fixture
def pool(tmp_path):
    path = f"/dev/shm/pd-fence-{os.getpid()}-{tmp_path.name}"
    with open_pool(path) as p:
        keys = [key_of(1000 + i) for i in range(p.num_slots - 1)]
        refs = p.reserve(keys)
        p.publish([(r, p.write(r, block(9)), SLOT) for r in refs], hold_s=60)  # all held
        yield p
    remove_pool(path)


def read(pool, i):
    (pinned,) = pool.pin([key_of(i)])
    assert pinned is not None
    out = np.empty((1, SLOT), np.uint8)
    pool.read_many([pinned], out)
    assert pool.unpin([pinned]) == [True]
    return out[0]


def _stalled_writer(path, mid_copy, reserved, go, result):
    """Reserve key 1 with a short lease, stall (before the copy, or inside its fence), then copy
    0xAA into the slot and publish."""
    pool = open_pool(path)
    (ref,) = pool.reserve([key_of(1)], write_lease_s=LEASE_S)
    if mid_copy:
        with pool.writing([ref]) as owned:
            reserved.put((ref.slot, ref.seq))
            go.wait(10)
            if owned[0]:
                pool.data[ref.slot] = block(0xAA)
        chk = 0
    else:
        reserved.put((ref.slot, ref.seq))
        go.wait(10)
        chk = pool.write(ref, block(0xAA))
    result.put(pool.publish([(ref, chk, SLOT)])[0])


def start_writer(pool, mid_copy):
    reserved, result, go = CTX.Queue(), CTX.Queue(), CTX.Event()
    proc = CTX.Process(target=_stalled_writer, args=(pool.path, mid_copy, reserved, go, result))
    proc.start()
    slot, seq = reserved.get(timeout=30)
    return proc, slot, seq, go, result


@pytest.mark.processes  # tests/tiers.py
def test_a_stalled_writer_whose_slot_was_taken_over_cannot_change_the_new_block(pool):
    proc, slot, seq, go, result = start_writer(pool, mid_copy=False)
    time.sleep(LEASE_S + 0.1)  # its lease runs out while it stalls before copying
    (ref,) = pool.reserve([key_of(1)])
    assert ref is not None and ref.slot == slot and ref.seq != seq  # the only slot to be had
    assert pool.publish([(ref, pool.write(ref, block(0x55)), SLOT)]) == [True]
    go.set()  # the stalled writer wakes up, copies, publishes
    assert result.get(timeout=30) is False
    proc.join(10)
    assert np.array_equal(read(pool, 1), block(0x55))  # its late copy never landed


@pytest.mark.processes  # tests/tiers.py
def test_a_writer_copying_past_its_lease_keeps_its_slot(pool):
    """Inside its fence a writer is alive and copying: a reserve that meets its lapsed lease
    renews it instead of handing the slot to someone else."""
    proc, slot, seq, go, result = start_writer(pool, mid_copy=True)
    time.sleep(LEASE_S + 0.1)
    assert pool.reserve([key_of(2)]) == [None]  # the pool is full: that slot is not free
    assert pool.reserve([key_of(1)]) == [None]  # nor is its key up for writing again
    assert pool.stats().writing == 1
    go.set()
    assert result.get(timeout=30) is True
    proc.join(10)
    assert np.array_equal(read(pool, 1), block(0xAA))


@pytest.mark.processes  # tests/tiers.py
def test_a_writer_killed_inside_its_fence_leaves_a_slot_that_is_reclaimed(pool):
    proc, slot, seq, go, result = start_writer(pool, mid_copy=True)
    proc.kill()  # the kernel drops its fence with it
    proc.join(10)
    time.sleep(LEASE_S + 0.1)
    (ref,) = pool.reserve([key_of(3)])
    assert ref is not None and ref.slot == slot


def test_threads_of_one_process_are_fenced_from_each_other(pool):
    """One handle, two threads: the fence is per thread (its own open file description), so the
    reserving thread still sees the copying thread's fence."""
    (ref,) = pool.reserve([key_of(1)], write_lease_s=LEASE_S)
    inside, go = threading.Event(), threading.Event()

    def copy():
        with pool.writing([ref]) as owned:
            inside.set()
            go.wait(10)
            if owned[0]:
                pool.data[ref.slot] = block(0xAA)

    t = threading.Thread(target=copy)
    t.start()
    inside.wait(10)
    time.sleep(LEASE_S + 0.1)
    assert pool.reserve([key_of(2)]) == [None]
    go.set()
    t.join(10)
    assert pool.publish([(ref, 0, SLOT)]) == [True]
    # and once it lapses outside a fence, the same thread's stale copy is refused
    (late,) = pool.reserve([key_of(4)], write_lease_s=0.0)
    (taken,) = pool.reserve([key_of(5)])  # pool full: takes the lapsed reservation's slot
    assert taken is not None and taken.slot == late.slot
    with pool.writing([late]) as owned:
        assert owned.tolist() == [False]
    with pool.writing([taken]) as owned:
        assert owned.tolist() == [True]


def test_write_many_skips_rows_whose_slots_are_gone(pool):
    """The rooms channel's copy (write_many): a lapsed row is not copied, the others are."""
    pool.release_hold(pool.lookup([key_of(1000)]).present())  # one evictable block
    (a,) = pool.reserve([key_of(7)], write_lease_s=0.0)  # the free slot; lapses at once
    (b,) = pool.reserve([key_of(8)])  # the evictable one; a's writer is not copying: a is freed
    (c,) = pool.reserve([key_of(9)])
    assert c.slot == a.slot
    before = pool.data[a.slot].copy()
    refs = SlotRefs.of([a, b])
    pool.write_many(refs, np.stack([block(1), block(2)]))
    assert np.array_equal(pool.data[a.slot], before)  # c's slot: not written by a's writer
    assert np.array_equal(pool.data[b.slot], block(2))
    assert pool.publish([(a, 0, SLOT), (b, 0, SLOT)]) == [False, True]


class _PausedBetweenReads(dict):
    """The pool's header columns, as the stale writer's fence check reads them: the first read
    of `state` (after `seq`) waits until told to go on, as a writer descheduled between its two
    header reads would."""

    def __init__(self, cols, paused, resume):
        super().__init__(cols)
        self.paused, self.resume, self.armed = paused, resume, True

    def __getitem__(self, name):
        if name == "state" and self.armed:
            self.armed = False
            self.paused.set()
            self.resume.wait(10)
        return super().__getitem__(name)


def _writer_paused_in_its_fence_check(path, how, freed, fence, paused, resume, result):
    """Reserve key 1, lose the reservation (`how`: its lease runs out, or this writer abandons it),
    then fence a copy of 0xAA, pausing between the check's two header reads."""
    pool = open_pool(path)
    (ref,) = pool.reserve([key_of(1)], write_lease_s=LEASE_S if how == "reclaimed" else 30)
    if how == "abandoned":
        pool.abandon([ref])
    freed.put((ref.slot, ref.seq))
    fence.wait(10)
    pool._cols = _PausedBetweenReads(pool._cols, paused, resume)
    with pool.writing([ref]) as owned:
        if owned[0]:
            pool.data[ref.slot] = block(0xAA)
    result.put(bool(owned[0]))


@pytest.mark.processes  # tests/tiers.py
@pytest.mark.parametrize("how", ["reclaimed", "abandoned"])
def test_a_freed_reservation_is_never_mistaken_for_its_next_owners(tmp_path, how):
    """A writer's reservation is freed (reclaimed once its lease ran out, or abandoned); the writer
    then checks its fence, reading the slot's generation, and is paused there until another writer
    has reserved the freed slot and copied into it (not yet published); then it reads the slot's state (WRITING: the
    new owner's). Freeing gives the slot a new generation, so the check fails and the stale copy
    never lands in the new owner's block. Three writers, two processes, one step at a time."""
    path = f"/dev/shm/pd-fence-{os.getpid()}-{tmp_path.name}"
    q, result = CTX.Queue(), CTX.Queue()
    fence, paused, resume = CTX.Event(), CTX.Event(), CTX.Event()
    try:
        with open_pool(path) as pool:
            proc = CTX.Process(target=_writer_paused_in_its_fence_check,
                               args=(path, how, q, fence, paused, resume, result))
            proc.start()
            slot, seq = q.get(timeout=30)
            if how == "reclaimed":
                time.sleep(LEASE_S + 0.1)
                (other,) = pool.reserve([key_of(2)])  # reclaims the lapsed reservation
                assert other is not None and other.slot != slot
                assert pool.stats().writing == 1  # only its own: the lapsed one was freed
            fence.set()
            assert paused.wait(30)  # the stale writer has read the slot's generation
            (new,) = pool.reserve([key_of(3)])
            assert new is not None and new.slot == slot  # the lowest free slot: the freed one
            chk = pool.write(new, block(0x55))  # copied; published only later (still WRITING)
            resume.set()
            assert result.get(timeout=30) is False  # the fence said: not yours any more
            proc.join(10)
            assert pool.publish([(new, chk, SLOT)]) == [True]
            assert np.array_equal(read(pool, 3), block(0x55))
    finally:
        resume.set()
        remove_pool(path)
