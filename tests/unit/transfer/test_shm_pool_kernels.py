"""The pool's compiled kernels on plain arrays laid out as the pool's header columns: lookups with
colliding key prefixes and repeated keys, the choice of slots to reuse, pins and unpins of the
same slot twice in one batch, and the one-pass copy with checksums."""

import numpy as np

from pd_plugins.transfer import shm_pool_kernels as k
from pd_plugins.transfer.shm_pool import checksum

FREE, WRITING, READY = k.FREE, k.WRITING, k.READY


def key(first8: int, rest: int) -> np.ndarray:
    """A 32-byte key whose first 8 bytes (the key64 column) and remainder are chosen apart."""
    return np.frombuffer(first8.to_bytes(8, "little") + rest.to_bytes(24, "little"), np.uint8)


def header(n: int) -> dict:
    return {"state": np.zeros(n, np.uint8), "key": np.zeros((n, 32), np.uint8),
            "key64": np.zeros(n, np.uint64), "hold_until": np.zeros(n), "readers": np.zeros(n, np.uint32),
            "read_until": np.zeros(n), "write_until": np.zeros(n), "last_use": np.zeros(n),
            "seq": np.zeros(n, np.uint64), "checksum": np.zeros(n, np.uint64),
            "nbytes": np.zeros(n, np.uint64)}


def put(h: dict, slot: int, row: np.ndarray, state: int = READY) -> None:
    h["state"][slot], h["key"][slot] = state, row
    h["key64"][slot] = k.key64_of(row[None])[0]


def test_find_compares_whole_keys_and_the_lowest_slot_wins():
    h = header(8)
    a, b = key(7, 1), key(7, 2)  # same key64, different keys
    put(h, 5, a)
    put(h, 2, b)
    put(h, 3, b)  # a second copy of b (a dead writer's and a later one's): slot 2 wins
    put(h, 6, key(9, 9), WRITING)
    rows = np.stack([a, b, a, key(9, 9), key(1, 1)])
    out = np.empty(5, np.int64)
    k.find(h["state"], h["key"], h["key64"], rows, True, False, out)
    assert out.tolist() == [5, 2, 5, -1, -1]
    k.find(h["state"], h["key"], h["key64"], rows, True, True, out)
    assert out.tolist() == [5, 2, 5, 6, -1]
    assert k.key64_of(a[None])[0] == 7


def test_victims_free_first_then_least_recently_used_in_slot_order():
    h = header(8)
    now = 100.0
    for s in range(8):
        put(h, s, key(s, s))
    h["state"][6] = FREE
    h["last_use"][:] = [5, 1, 3, 1, 9, 2, 0, 4]
    h["hold_until"][4] = now + 10        # held: never evicted
    h["readers"][1], h["read_until"][1] = 1, now + 10  # pinned by a live reader
    h["readers"][3], h["read_until"][3] = 1, now - 1   # a dead reader's pin: evictable
    out, expired = np.empty(8, np.int64), np.empty(8, np.int64)

    def victims(count):
        got, e = k.victims(h["state"], h["hold_until"], h["readers"], h["read_until"],
                           h["write_until"], h["last_use"], count, now, out, expired)
        return out[:got].tolist(), expired[:e].tolist()

    # the free slot, then the two least recently used evictable ones (3 at 1, 5 at 2), by slot
    assert victims(3) == ([6, 3, 5], [])
    h["last_use"][:] = 1.0  # all tied: the lowest slots among the evictable
    assert victims(4) == ([6, 0, 2, 3], [])
    assert sorted(victims(20)[0]) == [0, 2, 3, 5, 6, 7]  # all but the held and the pinned
    assert victims(0) == ([], [])
    # a reservation whose write lease ran out is never handed out: it is reported, so that the
    # pool can check whether its writer is still copying; a live write lease is neither
    h["state"][[0, 2]] = WRITING
    h["write_until"][0], h["write_until"][2] = now - 1, now + 10
    assert victims(20) == ([6, 3, 5, 7], [0])


def random_header(rng: np.random.Generator, n: int, now: float) -> dict:
    """A header in every state, with many equal use times, holds, live and dead pins and write
    leases, and keys drawn from a few values (so that batches repeat and share key64)."""
    h = header(n)
    for s in range(n):
        put(h, s, key(int(rng.integers(0, 4)), int(rng.integers(0, 6))),
            int(rng.choice([FREE, WRITING, READY], p=[0.05, 0.15, 0.8])))
    h["last_use"][:] = rng.integers(0, 20, n)
    h["hold_until"][:] = np.where(rng.random(n) < 0.1, now + 5, 0.0)
    h["readers"][:] = rng.random(n) < 0.1
    h["read_until"][:] = np.where(rng.random(n) < 0.5, now + 5, now - 5)
    h["write_until"][:] = np.where(rng.random(n) < 0.5, now + 5, now - 5)
    return h


def test_find_and_victims_match_plain_references_on_random_headers():
    """The kernels against the rules written out in Python: the lowest slot holding the key in
    an allowed state; free slots in slot order, then the evictable ones by (last use, slot)."""
    rng = np.random.default_rng(7)
    now = 50.0
    for _ in range(300):
        n = int(rng.integers(1, 200))
        h = random_header(rng, n, now)
        rows = np.stack([key(int(rng.integers(0, 4)), int(rng.integers(0, 6)))
                         for _ in range(int(rng.integers(1, 40)))])
        ready, writing = bool(rng.integers(0, 2)), bool(rng.integers(0, 2))
        allowed = ({READY} if ready else set()) | ({WRITING} if writing else set())
        out = np.empty(len(rows), np.int64)
        k.find(h["state"], h["key"], h["key64"], rows, ready, writing, out)
        expect = [next((s for s in range(n) if h["state"][s] in allowed
                        and bytes(h["key"][s]) == bytes(row)), -1) for row in rows]
        assert out.tolist() == expect

        count = int(rng.integers(0, n + 5))
        got, expired = np.empty(max(count, 1), np.int64), np.empty(max(count, 1), np.int64)
        m, e = k.victims(h["state"], h["hold_until"], h["readers"], h["read_until"],
                         h["write_until"], h["last_use"], count, now, got, expired)
        free = [s for s in range(n) if h["state"][s] == FREE][:count]
        evictable = sorted((s for s in range(n) if
                            h["state"][s] == READY and h["hold_until"][s] <= now
                            and (h["readers"][s] == 0 or h["read_until"][s] <= now)),
                           key=lambda s: (h["last_use"][s], s))
        assert got[:m].tolist() == free + sorted(evictable[:count - len(free)])
        lapsed = [s for s in range(n) if h["state"][s] == WRITING and h["write_until"][s] <= now]
        if m < count:  # too few to reuse: every lapsed reservation was reported (up to count)
            assert expired[:e].tolist() == lapsed[:count]
        else:  # enough: the pass may stop early, and what it reports is lapsed
            assert set(expired[:e].tolist()) <= set(lapsed) and e <= count


def test_pin_twice_in_one_batch_then_unpin_twice_leaves_no_reader_and_no_underflow():
    h = header(4)
    put(h, 2, key(3, 3))
    h["seq"][2] = 11
    rows = np.stack([key(3, 3), key(3, 3), key(4, 4)])
    slots, seqs, _, _ = k.pin(h["state"], h["key"], h["key64"], h["seq"], h["checksum"],
                              h["nbytes"], h["readers"], h["read_until"], h["last_use"], rows,
                              np.array([2, -1], np.int64), np.array([11, 0], np.uint64), 50.0, 30.0)
    assert slots.tolist() == [2, 2, -1] and seqs.tolist() == [11, 11, 0]
    assert h["readers"][2] == 2 and h["read_until"][2] == 80.0
    same = k.unpin(h["state"], h["seq"], h["readers"], slots[:2], seqs[:2])
    assert same.tolist() == [True, True] and h["readers"][2] == 0
    assert k.unpin(h["state"], h["seq"], h["readers"], slots[:1], seqs[:1]).tolist() == [True]
    assert h["readers"][2] == 0  # not wrapped around
    assert k.unpin(h["state"], h["seq"], h["readers"], np.array([-1, 9]),
                   np.zeros(2, np.uint64)).tolist() == [False, False]  # out of range: refused


def test_copy_rows_sums_what_it_copies():
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (5, 64), dtype=np.uint8)
    dst = np.zeros((8, 96), np.uint8)
    sums = np.zeros(3, np.uint64)
    k.copy_rows(src.view(np.uint64), np.array([4, 0, 2]), dst[:, :64].view(np.uint64),
                np.array([1, 7, 3]), sums)
    assert np.array_equal(dst[[1, 7, 3], :64], src[[4, 0, 2]])
    assert not dst[:, 64:].any() and not dst[[0, 2, 4, 5, 6]].any()
    assert sums.tolist() == [checksum(src[4]), checksum(src[0]), checksum(src[2])]
