"""The shared-memory KV pool under concurrency and crashes, with real processes on /dev/shm.

Writers publish block i under key i with content that is a function of i, so a reader can tell
a good copy from a torn or foreign one by comparing bytes.
"""

import hashlib
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from pd_plugins.transfer.shm_pool import ShmKVPool, checksum, remove_pool

pytestmark = pytest.mark.processes  # forked writers and readers (tests/tiers.py)

SLOT = 64 * 1024
NUM_KEYS = 200
CTX = mp.get_context("fork")


def open_pool(path, size=48 * SLOT):
    return ShmKVPool(path, slot_bytes=SLOT, layout="fault-test", size_bytes=size)


def key_of(i: int) -> bytes:
    return hashlib.sha256(b"k%d" % i).digest()


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, SLOT, dtype=np.uint8)


@pytest.fixture
def pool_path(tmp_path):
    path = f"/dev/shm/pd-fault-pool-{os.getpid()}-{tmp_path.name}"
    with open_pool(path):
        pass
    yield path
    remove_pool(path)


def _writer(path, seed, seconds, counts):
    pool = open_pool(path)
    rng = np.random.default_rng(seed)
    blocks = {}
    end = time.monotonic() + seconds
    written = 0
    while time.monotonic() < end:
        i = int(rng.integers(NUM_KEYS))
        (ref,) = pool.reserve([key_of(i)])
        if ref is None:
            continue
        data = blocks.setdefault(i, block(i))
        chk = pool.write(ref, data)
        written += pool.publish([(ref, chk, data.nbytes)])[0]
    counts.put(("written", written))


def _reader(path, seed, seconds, counts):
    pool = open_pool(path)
    rng = np.random.default_rng(seed)
    good = voided = wrong = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        i = int(rng.integers(NUM_KEYS))
        (pinned,) = pool.pin([key_of(i)])
        if pinned is None:
            continue
        copy = pool.read(pinned).copy()
        if not pool.unpin([pinned])[0]:
            voided += 1
            continue
        if checksum(copy) != pinned.checksum or not np.array_equal(copy, block(i)):
            wrong += 1
        else:
            good += 1
    counts.put(("good", good))
    counts.put(("voided", voided))
    counts.put(("wrong", wrong))


def test_two_writers_two_readers_never_consume_a_wrong_block(pool_path):
    counts = CTX.Queue()
    procs = [CTX.Process(target=_writer, args=(pool_path, s, 4.0, counts)) for s in (1, 2)]
    procs += [CTX.Process(target=_reader, args=(pool_path, s, 4.0, counts)) for s in (3, 4)]
    for p in procs:
        p.start()
    try:
        totals: dict[str, int] = {}
        for _ in range(2 + 3 * 2):
            name, n = counts.get(timeout=60)
            totals[name] = totals.get(name, 0) + n
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert totals["wrong"] == 0, totals
    # 200 keys over 48 slots: the writers evicted constantly while readers copied
    assert totals["written"] > 200 and totals["good"] > 100, totals


# Long enough that a loaded CI machine finishes the "still leased" checks
# inside it (0.5 s was not); the tests then sleep until it has run out.
LEASE_S = 4.0


def _die_mid_write(path, ready):
    pool = open_pool(path)
    leased_at = time.time()  # the pool's leases are wall-clock deadlines
    (ref,) = pool.reserve([key_of(1)], write_lease_s=LEASE_S)
    pool.data[ref.slot, : SLOT // 2] = 7  # half a block, then killed
    ready.send((ref.slot, leased_at))
    time.sleep(60)


def _die_mid_read(path, ready):
    pool = open_pool(path)
    leased_at = time.time()
    (pinned,) = pool.pin([key_of(2)], read_lease_s=LEASE_S)
    _ = pool.read(pinned)[: SLOT // 2].copy()
    ready.send((pinned.slot, leased_at))
    time.sleep(60)


def sleep_past_lease(leased_at: float) -> None:
    time.sleep(max(0.0, leased_at + LEASE_S + 0.1 - time.time()))


def assert_still_leased(leased_at: float) -> None:
    # the checks before this ran inside the dead process's lease, or they prove nothing
    assert time.time() < leased_at + LEASE_S, "machine too slow for LEASE_S"


def _die_holding_the_lock(path, ready):
    pool = open_pool(path)
    with pool._file_lock():
        ready.send(True)
        time.sleep(60)


def _run_and_kill(target, path):
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=target, args=(path, child))
    proc.start()
    try:
        assert parent.poll(30), "child did not get ready"
        value = parent.recv()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)
    return value


def fill(pool, start, hold_s=0.0):
    for i in range(start, start + 2 * pool.num_slots):
        (ref,) = pool.reserve([key_of(i)])
        if ref is not None:
            pool.publish([(ref, pool.write(ref, block(i)), SLOT)], hold_s=hold_s)


def test_writer_killed_mid_write_publishes_nothing_and_its_slot_comes_back(pool_path):
    slot, leased_at = _run_and_kill(_die_mid_write, pool_path)
    with open_pool(pool_path) as pool:
        assert pool.pin([key_of(1)]) == [None]  # the torn block is never visible
        assert pool.reserve([key_of(1)]) == [None]  # its writer's lease still runs
        assert_still_leased(leased_at)
        sleep_past_lease(leased_at)
        (ref,) = pool.reserve([key_of(1)])  # lease over: the key can be written again
        assert ref is not None
        pool.abandon([ref])
        fill(pool, 1000)
        assert pool.stats().writing == 0  # the dead writer's slot was reclaimed
        assert slot in {p.slot for p in pool.pin([key_of(i) for i in range(1000, 1000 + 2 * pool.num_slots)]) if p}


def test_reader_killed_mid_read_pins_only_until_its_lease_ends(pool_path):
    with open_pool(pool_path) as pool:
        (ref,) = pool.reserve([key_of(2)])
        pool.publish([(ref, pool.write(ref, block(2)), SLOT)])
    slot, leased_at = _run_and_kill(_die_mid_read, pool_path)
    with open_pool(pool_path) as pool:
        fill(pool, 5000)
        (ref,) = pool.lookup([key_of(2)])
        assert_still_leased(leased_at)
        assert ref is not None and ref.slot == slot  # still pinned by the dead reader: kept
        sleep_past_lease(leased_at)
        fill(pool, 9000)
        assert pool.pin([key_of(2)]) == [None]  # its lease ran out: evicted like any other


def test_a_process_killed_holding_the_lock_does_not_lock_the_pool(pool_path):
    _run_and_kill(_die_holding_the_lock, pool_path)
    with open_pool(pool_path) as pool:
        start = time.monotonic()
        fill(pool, 0)
        assert time.monotonic() - start < 5
