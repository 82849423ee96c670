"""The shared-memory KV pool's hot paths, compiled (numba): header updates and copy-with-checksum.

Each of the pool's locked calls (reserve, publish, hold, pin, unpin, lookup) is one call into a kernel
here, which walks the batch and the header columns in plain loops. As numpy the same work took a
few dozen array operations per call, ~400 us per batch right after a large copy had swept the
caches: as much as copying 128 blocks of 64 KiB (docs/benchmarks.md, "Shared-memory KV pool
bandwidth"). A kernel is one function entered once.

`copy_rows` copies rows of u64 words and sums them in the same pass (the pool's checksum: a
wrapping 64-bit sum of a slot's words), so checksums cost no second pass over the data. Its stores
are non-temporal (they go to memory around the caches): a block is written once and read by
another process or the engine much later, so caching it only evicts other data, and an ordinary
store first reads the line it overwrites. By hand on this machine (64 MiB, cold caches), the
one-pass copy and sum ran at 0.90-1.02x np.copyto with ordinary stores and 1.10-1.20x with
non-temporal ones, 64 KiB to 4 MiB blocks (bench/shm_pool_bandwidth.py measures it each run).

The kernels see the header as shm_pool.py lays it out (one array per field, a slot per
element) and take the caller's lock for granted. numba compiles each kernel on its first call in a
process and caches the machine code next to this file (`cache=True`), so later processes load it.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

FREE, WRITING, READY = 0, 1, 2  # slot states (shm_pool.py re-exports these)
KEY_BYTES = 32
_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: spreads any key bits

jit = numba.njit(cache=True, nogil=True)


@jit
def key64_of(rows):
    """Each key's first 8 bytes as a little-endian u64: the key64 column's value for it."""
    out = np.empty(rows.shape[0], np.uint64)
    for i in range(rows.shape[0]):
        v = np.uint64(0)
        for b in range(7, -1, -1):
            v = (v << np.uint64(8)) | np.uint64(rows[i, b])
        out[i] = v
    return out


@jit
def find(state, key, key64, rows, ready, writing, out):
    """out[i]: the lowest slot holding key rows[i] in state READY (if `ready`) or WRITING (if
    `writing`), else -1. The batch's keys go into an open-addressing table at most 1/16 full; one
    pass over the slots probes it, so a call costs O(slots + keys), and a slot holding none of
    the keys (nearly all of them in a large pool) costs one probe that finds an empty entry."""
    n = rows.shape[0]
    out[:] = -1
    if n == 0:
        return
    k64 = key64_of(rows)
    bits = 4
    while (1 << bits) < 16 * n:
        bits += 1
    shift = np.uint64(64 - bits)
    mask = np.uint64((1 << bits) - 1)
    table = np.full(1 << bits, -1, np.int64)
    for i in range(n):
        h = (k64[i] * _FIBONACCI) >> shift
        while table[h] != -1:
            h = (h + np.uint64(1)) & mask
        table[h] = i
    for s in range(state.shape[0]):
        v = key64[s]
        h = (v * _FIBONACCI) >> shift
        while table[h] != -1:
            i = table[h]
            if k64[i] == v and out[i] == -1:
                st = state[s]
                if (st == READY and ready) or (st == WRITING and writing):
                    same = True
                    for b in range(KEY_BYTES):
                        if key[s, b] != rows[i, b]:
                            same = False
                            break
                    if same:
                        out[i] = s
            h = (h + np.uint64(1)) & mask


@jit
def _later(t1, s1, t2, s2):
    """(t1, s1) after (t2, s2): used later, or at the same time and a higher slot."""
    return t1 > t2 or (t1 == t2 and s1 > s2)


@jit
def _heap_push(times, slots, size, t, s):
    """Add (t, s) to the max-heap (by _later) times[:size], slots alongside; returns the size."""
    j = size
    while j > 0:
        parent = (j - 1) >> 1
        if not _later(t, s, times[parent], slots[parent]):
            break
        times[j], slots[j] = times[parent], slots[parent]
        j = parent
    times[j], slots[j] = t, s
    return size + 1


@jit
def _heap_replace_top(times, slots, size, t, s):
    """Replace the latest entry of the max-heap times[:size] with (t, s)."""
    j = 0
    while True:
        child = 2 * j + 1
        if child >= size:
            break
        if child + 1 < size and _later(times[child + 1], slots[child + 1], times[child],
                                       slots[child]):
            child += 1
        if not _later(times[child], slots[child], t, s):
            break
        times[j], slots[j] = times[child], slots[child]
        j = child
    times[j], slots[j] = t, s


@jit
def victims(state, hold_until, readers, read_until, write_until, last_use, count, now, out,
            expired):
    """Fill out[:k] with up to `count` slots to reuse and return (k, e): free slots first, in
    slot order (consecutive blocks land in consecutive slots and copy as one run), then the least
    recently used evictable ones (no hold, no live pin; at equal times the lower slots), in slot
    order. A reservation whose write lease ran out is not reused here: it goes to expired[:e]
    (at most `count`), for the caller to check whether its writer is still copying
    (ShmKVPool._reclaim).

    One pass: it keeps the free slots it meets and, in a max-heap of `count` entries, the least
    recently used evictable slots met so far, so a slot of a large full pool costs a state check
    and a comparison with the heap's top."""
    k = 0
    e = 0
    if count <= 0:
        return k, e
    heap_times = np.empty(count, np.float64)
    heap_slots = np.empty(count, np.int64)
    size = 0
    for s in range(state.shape[0]):
        st = state[s]
        if st == FREE:
            out[k] = s
            k += 1
            if k == count:
                return k, e
            continue
        # slots come in increasing order: at the top's time this one is later than the top
        if size == count and last_use[s] >= heap_times[0]:
            continue
        if st == WRITING:
            if write_until[s] <= now and e < count:
                expired[e] = s
                e += 1
            continue
        if st == READY and hold_until[s] <= now and (readers[s] == 0 or read_until[s] <= now):
            if size < count:
                size = _heap_push(heap_times, heap_slots, size, last_use[s], s)
            else:
                _heap_replace_top(heap_times, heap_slots, size, last_use[s], s)
    need = min(count - k, size)
    if need <= 0:
        return k, e
    # the heap's `need` earliest: by slot, then (stable) by time; handed out in slot order
    by_slot = np.argsort(heap_slots[:size])
    by_time = by_slot[np.argsort(heap_times[:size][by_slot], kind="mergesort")]
    picked = np.sort(heap_slots[:size][by_time[:need]])
    for j in range(need):
        out[k] = picked[j]
        k += 1
    return k, e


@jit
def reserve(state, key, key64, content_key, seq, write_until, hold_until, readers, read_until,
            last_use, writer_pid, next_seq, rows, content_keys, now, lease_s, pid):
    """Reserve a slot (state WRITING, a write lease, a new generation) for each key that is not
    published or being written by a live writer: (slots, generations, expired), slot -1 for the
    others and for keys left over when no slot can be reused; `expired`: reservations met whose
    write lease ran out, which this call does not reuse (see `victims`). content_keys: one per
    key, or none (0)."""
    n = rows.shape[0]
    out_slots = np.full(n, -1, np.int64)
    out_seqs = np.zeros(n, np.uint64)
    k64 = key64_of(rows)
    present = np.empty(n, np.int64)
    find(state, key, key64, rows, True, True, present)
    wanted = np.empty(n, np.int64)
    w = 0
    for i in range(n):
        p = present[i]
        if p < 0 or (state[p] == WRITING and write_until[p] <= now):  # absent, or a dead writer
            wanted[w] = i
            w += 1
    slots = np.empty(w, np.int64)
    expired = np.empty(w, np.int64)
    got, n_expired = victims(state, hold_until, readers, read_until, write_until, last_use, w,
                             now, slots, expired)
    seq0 = next_seq[0]
    for j in range(got):
        i, s = wanted[j], slots[j]
        write_until[s] = now + lease_s  # first: a kill from here on leaves a lease that runs out
        state[s] = WRITING  # then: the slot's old content is gone from now on
        seq[s] = seq0 + np.uint64(j)
        key[s, :] = rows[i, :]
        key64[s] = k64[i]
        content_key[s] = content_keys[i] if content_keys.shape[0] else 0
        hold_until[s] = 0.0
        readers[s] = 0
        read_until[s] = 0.0
        last_use[s] = now
        writer_pid[s] = pid
        out_slots[i] = s
        out_seqs[i] = seq0 + np.uint64(j)
    next_seq[0] = seq0 + np.uint64(got)
    return out_slots, out_seqs, expired[:n_expired]


@jit
def publish(state, seq, checksum, nbytes, hold_until, last_use, slots, seqs, sums, sizes, now,
            hold_s):
    """Publish written slots (sizes: one per slot, or one for all); False where the write lease
    ran out and the slot was taken over (its data may be torn: it stays unpublished)."""
    ok = np.zeros(slots.shape[0], np.bool_)
    for i in range(slots.shape[0]):
        s = slots[i]
        ok[i] = 0 <= s < state.shape[0] and seq[s] == seqs[i] and state[s] == WRITING
        if ok[i]:
            checksum[s] = sums[i]
            nbytes[s] = sizes[i] if sizes.shape[0] > 1 else sizes[0]
            hold_until[s] = now + hold_s
            last_use[s] = now
            state[s] = READY  # last: readers see a complete entry
    return ok


@jit
def hold(state, seq, hold_until, slots, seqs, until):
    """Hold published slots until at least `until` (a hold is never shortened); False where the
    slot no longer holds that generation, READY (evicted, dropped or reused since it was found)."""
    ok = np.zeros(slots.shape[0], np.bool_)
    for i in range(slots.shape[0]):
        s = slots[i]
        ok[i] = 0 <= s < state.shape[0] and seq[s] == seqs[i] and state[s] == READY
        if ok[i] and hold_until[s] < until:
            hold_until[s] = until
    return ok


@jit
def pin(state, key, key64, seq, checksum, nbytes, readers, read_until, last_use, rows,
        hint_slots, hint_seqs, now, lease_s):
    """Pin the published slot of each key: (slots, generations, checksums, sizes), slot -1 where
    not published. A hint (slot and generation; none past the hints' end or at slot -1) is used
    only if that slot still holds exactly this key; the other keys are looked up. A pin whose
    read lease ran out belonged to a dead reader: it is dropped."""
    n = rows.shape[0]
    out_slots = np.empty(n, np.int64)
    out_seqs = np.zeros(n, np.uint64)
    out_sums = np.zeros(n, np.uint64)
    out_sizes = np.zeros(n, np.uint64)
    missing = np.empty(n, np.int64)
    m = 0
    for i in range(n):
        s = hint_slots[i] if i < hint_slots.shape[0] else -1
        good = s >= 0 and s < state.shape[0] and seq[s] == hint_seqs[i] and state[s] == READY
        if good:
            for b in range(KEY_BYTES):
                if key[s, b] != rows[i, b]:
                    good = False
                    break
        out_slots[i] = s if good else -1
        if not good:
            missing[m] = i
            m += 1
    if m:
        found = np.empty(m, np.int64)
        find(state, key, key64, rows[missing[:m]], True, False, found)
        for j in range(m):
            out_slots[missing[j]] = found[j]
    for i in range(n):
        s = out_slots[i]
        if s < 0:
            continue
        if readers[s] > 0 and read_until[s] <= now:
            readers[s] = 0  # earlier pins whose lease ran out: dead readers
        readers[s] += 1
        read_until[s] = max(read_until[s], now + lease_s)
        last_use[s] = now
        out_seqs[i], out_sums[i], out_sizes[i] = seq[s], checksum[s], nbytes[s]
    return out_slots, out_seqs, out_sums, out_sizes


@jit
def unpin(state, seq, readers, slots, seqs):
    """Release pins; True where the slot kept its generation throughout (the copy made while
    pinned is good)."""
    same = np.zeros(slots.shape[0], np.bool_)
    for i in range(slots.shape[0]):
        s = slots[i]
        same[i] = 0 <= s < state.shape[0] and seq[s] == seqs[i] and state[s] == READY
        if same[i] and readers[s] > 0:
            readers[s] -= 1
    return same


@intrinsic
def _stream_store(typingctx, array, index, value):
    """array[index] = value as a non-temporal store (LLVM's `!nontemporal`: MOVNTI on x86-64,
    an ordinary store where the target has none). Not ordered with later stores: fence after."""
    if not isinstance(array, types.Array) or array.ndim != 1 or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        array_type, index_type, value_type = signature.args
        ary = context.make_array(array_type)(context, builder, args[0])
        at = context.cast(builder, args[1], index_type, types.intp)
        ptr = cgutils.get_item_pointer(context, builder, array_type, ary, [at], wraparound=False)
        value = context.cast(builder, args[2], value_type, array_type.dtype)
        store = builder.store(value, ptr, align=array_type.dtype.bitwidth // 8)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return types.void(array, index, value), codegen


@intrinsic
def _store_fence(typingctx):
    """A full fence (MFENCE on x86-64, DMB on Arm): every store before it, non-temporal ones
    included, is visible to other processes before any store after it (the pool's publish)."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@jit
def copy_rows(src, src_at, dst, dst_at, sums):
    """Copy row src_at[j] of src to row dst_at[j] of dst (u64 words, the narrower width), and put
    each row's wrapping sum, taken from the words as they were copied, in sums[j]. The stores
    bypass the caches; the copies are visible to other processes when this returns."""
    width = min(src.shape[1], dst.shape[1])
    for j in range(src_at.shape[0]):
        a, b = src[src_at[j]], dst[dst_at[j]]
        total = np.uint64(0)
        for w in range(width):
            x = a[w]
            _stream_store(b, w, x)
            total += x
        sums[j] = total
    _store_fence()


def warm_up() -> None:
    """Compile (or load from the cache) every kernel for the argument types the pool passes, so
    that the first request does not wait for numba: the first process ever takes seconds here,
    later ones load the cached code. Called when a pool is opened."""
    global _warm
    if _warm:
        return
    n = 2
    state, seq, u64 = np.zeros(n, np.uint8), np.zeros(n, np.uint64), np.zeros(n, np.uint64)
    f8, readers, pid = np.zeros(n), np.zeros(n, np.uint32), np.zeros(n, np.int32)
    key, key64, ints = np.zeros((n, KEY_BYTES), np.uint8), np.zeros(n, np.uint64), np.zeros(n, np.int64)
    rows = np.frombuffer(bytes(KEY_BYTES), np.uint8).reshape(1, KEY_BYTES)  # read-only, as keys are
    slots, seqs, _ = reserve(state, key, key64, ints, seq, f8, f8, readers, f8, f8, pid,
                             np.ones(1, np.uint64), rows, np.zeros(0, np.int64), 0.0, 1.0, 1)
    publish(state, seq, u64, u64, f8, f8, slots, seqs, u64[:1], u64[:1], 0.0, 0.0)
    hold(state, seq, f8, slots, seqs, 0.0)
    pinned = pin(state, key, key64, seq, u64, u64, readers, f8, f8, rows, np.zeros(0, np.int64),
                 np.zeros(0, np.uint64), 0.0, 1.0)
    unpin(state, seq, readers, pinned[0], pinned[1])
    find(state, key, key64, rows, True, False, np.empty(1, np.int64))
    # copies: whole rows (C-contiguous) and column slices of wider rows (a layer of a slot)
    wide = np.zeros((n, 2), np.uint64)
    for src in (wide, wide[:, :1]):
        for dst in (wide, wide[:, :1]):
            copy_rows(src, ints, dst, ints, u64)
    _warm = True


_warm = False
