"""A KV block pool in shared memory: fixed-size slots in one memory-mapped region.

Any process on the host (or on the rack, for CXL memory) maps the same region: a file on /dev/shm
by default, a DAX device (`/dev/daxX.Y`) or any file. One slot holds one KV block of every layer;
a slot is found by its key (the engine's block hash), so the pool is also a prefix cache that every
engine mapping it can read.

Layout: a 4 KiB superblock, then one column per slot-header field (struct of arrays, so a lookup
is one vectorised compare), then the slots themselves, page aligned.

Who may touch a slot, and when:
- Every header change happens under one lock: `flock` on the region's file plus a thread lock.
  The kernel drops a `flock` when its holder dies, so a killed process never leaves the pool
  locked. Data copies run outside the lock.
- A writer reserves a slot (state WRITING, a write lease), copies the data, then publishes it
  (state READY, checksum) in a second, later header change: data first, index entry second.
  A writer killed mid-copy never publishes; its lease runs out and the slot is reclaimed.
- A reader pins a READY slot (reader count and a read lease), copies, then unpins. Unpinning
  reports whether the slot kept its generation (`seq`) throughout: a slot is only reused once
  it has no live pins, so a changed generation means the copy may be torn and must not be used.
  A reader killed mid-copy leaves its pin behind only until its read lease runs out.
- A published block may carry a hold (`hold_until`): the prefill's promise to the decode that
  the block stays until then. Eviction is LRU over slots with no hold, no live pin, and no live
  write lease.
- Checksums (a 64-bit sum of the slot's words, taken by the writer from its source data) let a
  reader check the bytes themselves: what keeps the pool correct on memory that is not cache
  coherent across hosts, where a generation check alone cannot see stale lines. They cost a
  second pass over the data (~20% of a copy's time); a pool is created with or without them.

Engine-agnostic: numpy and the standard library only.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

MAGIC = b"PDSHMPL1"
SUPERBLOCK_BYTES = 4096
LAYOUT_BYTES = 2048           # the engine's KV layout description, checked on every open
SLOT_ALIGN = 64               # slot size granularity (a cache line; checksums read u64 words)
PAGE = 4096
KEY_BYTES = 32
MADV_POPULATE_WRITE = 23      # linux/mman.h

FREE, WRITING, READY = 0, 1, 2
FLAG_CHECKSUMS = 1            # writers sum every slot, readers check the sums

DEFAULT_WRITE_LEASE_S = 30.0  # a writer that has not published by then is presumed dead
DEFAULT_READ_LEASE_S = 30.0   # likewise for a reader that has not unpinned


class PoolError(RuntimeError):
    """The region cannot serve as this pool (wrong layout, too small, not a pool)."""


# Header columns: name -> (dtype, elements per slot). Order fixes the on-memory layout.
_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("state", "u1", 1),
    ("key", "u1", KEY_BYTES),
    ("key64", "u8", 1),        # the key's first 8 bytes: the vectorised lookup column
    ("content_key", "i8", 1),  # a caller-defined second key (the router's block key)
    ("seq", "u8", 1),          # generation: new on every reservation; 0 = never used
    ("checksum", "u8", 1),
    ("nbytes", "u8", 1),
    ("write_until", "f8", 1),
    ("hold_until", "f8", 1),
    ("readers", "u4", 1),
    ("read_until", "f8", 1),
    ("last_use", "f8", 1),
    ("writer_pid", "i4", 1),
)
_SUPER_DTYPE = np.dtype([
    ("magic", "S8"), ("version", "<u4"), ("flags", "<u4"), ("slot_bytes", "<u8"),
    ("num_slots", "<u8"), ("data_offset", "<u8"), ("next_seq", "<u8"), ("created", "<f8"),
    ("uuid", "V16"), ("layout", f"S{LAYOUT_BYTES}"),
])


def checksum(data: np.ndarray) -> int:
    """64-bit wrapping sum of the data's 8-byte words (the data is padded to 8 bytes by the pool)."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    usable = flat[: flat.size - flat.size % 8].view(np.uint64)
    total = int(np.add.reduce(usable, dtype=np.uint64)) if usable.size else 0
    tail = flat[usable.size * 8:]
    return (total + int.from_bytes(tail.tobytes(), "little")) & 0xFFFF_FFFF_FFFF_FFFF


def row_checksums(rows: np.ndarray) -> np.ndarray:
    """`checksum` of every row at once (rows: [n, bytes], bytes a multiple of 8)."""
    return np.add.reduce(np.ascontiguousarray(rows).view(np.uint64), axis=1, dtype=np.uint64)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _headers_bytes(num_slots: int) -> int:
    return sum(np.dtype(dt).itemsize * width * num_slots for _, dt, width in _COLUMNS)


def pool_geometry(region_bytes: int, slot_bytes: int) -> tuple[int, int, int]:
    """(slot size rounded up, number of slots, data offset) that fit in a region."""
    slot_bytes = _round_up(slot_bytes, SLOT_ALIGN)
    per_slot = slot_bytes + _headers_bytes(1)
    num_slots = max(0, (region_bytes - SUPERBLOCK_BYTES - PAGE) // per_slot)
    data_offset = _round_up(SUPERBLOCK_BYTES + _headers_bytes(num_slots), PAGE)
    while num_slots and data_offset + num_slots * slot_bytes > region_bytes:
        num_slots -= 1
        data_offset = _round_up(SUPERBLOCK_BYTES + _headers_bytes(num_slots), PAGE)
    return slot_bytes, num_slots, data_offset


@dataclass(frozen=True)
class SlotRef:
    """A slot at one generation: what a reservation, a lookup or a pin refers to."""

    slot: int
    seq: int


@dataclass(frozen=True)
class PinnedSlot:
    slot: int
    seq: int
    checksum: int
    nbytes: int


@dataclass
class PoolStats:
    num_slots: int
    free: int
    writing: int
    ready: int
    pinned: int
    held: int


class ShmKVPool:
    """One process's handle on the pool. Thread-safe; share one per process."""

    def __init__(self, path: str, *, slot_bytes: int | None, layout: str | None,
                 size_bytes: int | None = None, create: bool = True,
                 prefault: bool = True, checksums: bool = True) -> None:
        """Map the pool at `path`, creating it if it does not exist (and `create`).

        `slot_bytes` and `layout` (a description of the engine's KV block: model, dtype, shapes)
        must match what the pool was created with: a pool serves one KV layout. Both None
        attaches to an existing pool whatever its layout (`attach`).
        `size_bytes` is the region size to create (a DAX device has its own size).
        `checksums` is the pool's setting when this call creates it; an existing pool keeps its
        own (`self.checksums`): every writer and reader of a pool must agree.
        """
        if (slot_bytes is None) != (layout is None) or (layout is None and create):
            raise ValueError("give slot_bytes and layout, or neither with create=False")
        layout_b = layout.encode() if layout is not None else None
        if layout_b is not None and len(layout_b) > LAYOUT_BYTES:
            raise PoolError(f"layout description longer than {LAYOUT_BYTES} bytes")
        self.path = path
        self._thread_lock = threading.Lock()
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            self._fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise PoolError(f"cannot open KV pool {path}: {exc}") from exc
        try:
            with self._file_lock():
                self._map(size_bytes, slot_bytes, layout_b, create, checksums)
        except BaseException:
            os.close(self._fd)
            raise
        if prefault:
            self._prefault()

    # -- opening -------------------------------------------------------------------------------
    def _region_size(self) -> int:
        st = os.fstat(self._fd)
        if stat.S_ISCHR(st.st_mode):  # a DAX device: its size is in sysfs
            major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
            with open(f"/sys/dev/char/{major}:{minor}/size") as f:
                return int(f.read())
        return st.st_size

    @classmethod
    def attach(cls, path: str, prefault: bool = False) -> ShmKVPool:
        """Map an existing pool, whatever KV layout it serves (tools, tests, the router)."""
        return cls(path, slot_bytes=None, layout=None, create=False, prefault=prefault)

    def _map(self, size_bytes: int | None, slot_bytes: int | None, layout: bytes | None,
             create: bool, checksums: bool) -> None:
        size = self._region_size()
        if size == 0:
            if not create or not size_bytes:
                raise PoolError(f"{self.path} is empty and no pool size was given")
            os.ftruncate(self._fd, size_bytes)
            size = size_bytes
        self._mm = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        sb = np.frombuffer(self._mm, dtype=_SUPER_DTYPE, count=1)[0:1]
        self._super = sb
        if sb["magic"][0] != MAGIC:
            if not create:
                raise PoolError(f"{self.path} is not a pd-plugins KV pool")
            self._format(size, slot_bytes, layout, checksums)
        if layout is None:  # attach
            slot_bytes, layout = int(sb["slot_bytes"][0]), bytes(sb["layout"][0])
        want_slot = _round_up(slot_bytes, SLOT_ALIGN)
        self.layout = layout.decode()
        if int(sb["slot_bytes"][0]) != want_slot or bytes(sb["layout"][0]) != layout:
            raise PoolError(
                f"KV pool {self.path} was made for another KV layout: it has "
                f"{int(sb['slot_bytes'][0])}-byte slots for {bytes(sb['layout'][0]).decode()!r}, "
                f"this engine needs {want_slot}-byte slots for {layout.decode()!r}. "
                f"Give each model its own pool path.")
        self.slot_bytes = want_slot
        self.pool_id = bytes(sb["uuid"][0]).hex()  # names this pool in transfer params
        self.checksums = bool(int(sb["flags"][0]) & FLAG_CHECKSUMS)
        self.num_slots = int(sb["num_slots"][0])
        if self.num_slots == 0:
            raise PoolError(f"KV pool {self.path} is too small for one {want_slot}-byte slot")
        offset = SUPERBLOCK_BYTES
        self._cols: dict[str, np.ndarray] = {}
        for name, dt, width in _COLUMNS:
            count = self.num_slots * width
            col = np.frombuffer(self._mm, dtype=dt, count=count, offset=offset)
            self._cols[name] = col.reshape(self.num_slots, width) if width > 1 else col
            offset += col.nbytes
        data_offset = int(sb["data_offset"][0])
        self.data = np.frombuffer(self._mm, dtype=np.uint8, count=self.num_slots * self.slot_bytes,
                                  offset=data_offset).reshape(self.num_slots, self.slot_bytes)

    def _format(self, size: int, slot_bytes: int, layout: bytes, checksums: bool) -> None:
        slot_bytes, num_slots, data_offset = pool_geometry(size, slot_bytes)
        self._mm[:data_offset] = bytes(data_offset)
        sb = self._super
        sb["slot_bytes"], sb["num_slots"], sb["data_offset"] = slot_bytes, num_slots, data_offset
        sb["version"], sb["next_seq"], sb["created"] = 1, 1, time.time()
        sb["flags"] = FLAG_CHECKSUMS if checksums else 0
        sb["layout"] = layout
        sb["uuid"] = np.frombuffer(os.urandom(16), dtype="V16")[0]
        sb["magic"] = MAGIC  # last: a pool is only a pool once its header is complete

    def _prefault(self) -> None:
        """Map every page now: a first touch inside a copy runs ~8x slower (engines.md §5)."""
        try:  # Python names MADV_POPULATE_WRITE from 3.13; Linux has it since 5.14
            self._mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", MADV_POPULATE_WRITE))
        except OSError:  # an older kernel: touch one byte per page instead
            view = np.frombuffer(self._mm, dtype=np.uint8)
            view[::PAGE] = view[::PAGE]

    def close(self) -> None:
        cols = getattr(self, "_cols", None)
        if cols is None:
            return
        self._cols, self.data, self._super = None, None, None  # drop views before unmapping
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process
        os.close(self._fd)

    def __enter__(self) -> ShmKVPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- locking ---------------------------------------------------------------------------------
    class _Locked:
        def __init__(self, pool: ShmKVPool) -> None:
            self.pool = pool

        def __enter__(self):
            self.pool._thread_lock.acquire()
            try:
                fcntl.flock(self.pool._fd, fcntl.LOCK_EX)
            except BaseException:
                self.pool._thread_lock.release()
                raise

        def __exit__(self, *exc) -> None:
            fcntl.flock(self.pool._fd, fcntl.LOCK_UN)
            self.pool._thread_lock.release()

    def _file_lock(self) -> _Locked:
        return ShmKVPool._Locked(self)

    # -- lookup ----------------------------------------------------------------------------------
    # Header work is vectorised per batch (one np.isin over the key column for all keys of a
    # call; fields written with fancy indexing). It still costs ~5-8 us per block (numpy call
    # overhead, plus scans that grow with the pool): small next to copying a real model's block
    # of every layer (MiBs), large next to tiny blocks (docs/benchmarks.md, "Shared-memory KV
    # pool bandwidth"). A hash index in the region would make lookups independent of pool size.
    @staticmethod
    def _key64(keys: Sequence[bytes]) -> np.ndarray:
        return np.array([int.from_bytes(k[:8], "little") for k in keys], dtype=np.uint64)

    def _find_many(self, keys: Sequence[bytes], states: tuple[int, ...] = (READY,)) -> np.ndarray:
        """Slot of each key in one of `states`, or -1 (caller holds the lock)."""
        c = self._cols
        out = np.full(len(keys), -1, dtype=np.int64)
        if not keys:
            return out
        k64 = self._key64(keys)
        found = np.flatnonzero(np.isin(c["key64"], k64) & np.isin(c["state"], states))
        by64: dict[int, list[int]] = {}
        for slot in found.tolist():
            by64.setdefault(int(c["key64"][slot]), []).append(slot)
        for i, key in enumerate(keys):
            for slot in by64.get(int(k64[i]), ()):
                if c["key"][slot].tobytes() == key:
                    out[i] = slot
                    break
        return out

    def lookup(self, keys: Sequence[bytes]) -> list[SlotRef | None]:
        """Where each key is published now (None: not in the pool). A hint: pin before reading."""
        with self._file_lock():
            slots = self._find_many(keys)
            seqs = self._cols["seq"][np.maximum(slots, 0)]
        return [None if s < 0 else SlotRef(int(s), int(q)) for s, q in zip(slots, seqs)]

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are published."""
        n = 0
        for ref in self.lookup(keys):
            if ref is None:
                break
            n += 1
        return n

    def published_content_keys(self) -> np.ndarray:
        """The content keys of every published slot, read without the lock (a routing hint)."""
        c = self._cols
        return c["content_key"][c["state"] == READY].copy()

    # -- writing ---------------------------------------------------------------------------------
    def _victims(self, count: int, now: float) -> np.ndarray:
        """Up to `count` slots to reuse: free ones first, in slot order (consecutive blocks land
        in consecutive slots and copy as one run), then the least recently used evictable."""
        c = self._cols
        free = np.flatnonzero(c["state"] == FREE)
        if free.size >= count:
            return free[:count]
        evictable = np.flatnonzero(
            ((c["state"] == READY) & (c["hold_until"] <= now)
             & ((c["readers"] == 0) | (c["read_until"] <= now)))
            | ((c["state"] == WRITING) & (c["write_until"] <= now)))
        need = count - free.size
        if evictable.size > need:
            evictable = evictable[np.argpartition(c["last_use"][evictable], need - 1)[:need]]
        return np.concatenate([free, np.sort(evictable)])

    def reserve(self, keys: Sequence[bytes], content_keys: Sequence[int] | None = None,
                write_lease_s: float = DEFAULT_WRITE_LEASE_S) -> list[SlotRef | None]:
        """Reserve one slot per key to write into. None for a key already published or being
        written by a live writer (nothing to do), or when every slot is in use (pool full)."""
        out: list[SlotRef | None] = [None] * len(keys)
        with self._file_lock():
            c = self._cols
            now = time.time()
            present = self._find_many(keys, (READY, WRITING))
            live = present >= 0
            writing = np.flatnonzero(live)[c["state"][present[live]] == WRITING]
            live[writing[c["write_until"][present[writing]] <= now]] = False  # dead writers
            wanted = np.flatnonzero(~live)
            slots = self._victims(len(wanted), now)
            wanted = wanted[:slots.size]
            if not wanted.size:
                return out
            seq0 = int(self._super["next_seq"][0])
            seqs = np.arange(seq0, seq0 + wanted.size, dtype=np.uint64)
            c["state"][slots] = WRITING  # first: the slots' old content is gone from now on
            c["seq"][slots] = seqs
            c["key"][slots] = np.frombuffer(b"".join(keys[i] for i in wanted),
                                            dtype=np.uint8).reshape(-1, KEY_BYTES)
            c["key64"][slots] = self._key64([keys[i] for i in wanted])
            c["content_key"][slots] = ([content_keys[i] for i in wanted]
                                       if content_keys is not None else 0)
            c["write_until"][slots] = now + write_lease_s
            c["hold_until"][slots] = 0.0
            c["readers"][slots] = 0
            c["read_until"][slots] = 0.0
            c["last_use"][slots] = now
            c["writer_pid"][slots] = os.getpid()
            self._super["next_seq"] = seq0 + wanted.size
        for i, slot, seq in zip(wanted.tolist(), slots.tolist(), seqs.tolist()):
            out[i] = SlotRef(slot, seq)
        return out

    def write(self, ref: SlotRef, data: np.ndarray) -> int:
        """Copy `data` (any contiguous array) into a reserved slot; returns its checksum (0 in
        a pool without checksums)."""
        src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if src.size > self.slot_bytes:
            raise ValueError(f"{src.size} bytes do not fit a {self.slot_bytes}-byte slot")
        self.data[ref.slot, :src.size] = src
        return checksum(src) if self.checksums else 0

    def write_many(self, refs: Sequence[SlotRef], rows: np.ndarray) -> np.ndarray:
        """Copy rows ([n, nbytes] uint8, nbytes a multiple of 8) into reserved slots, one copy
        per run of consecutive slots; returns each row's checksum (zeros without checksums)."""
        return copy_runs(rows, range(len(refs)), self.data, [r.slot for r in refs],
                         sum_source=True if self.checksums else None)

    def publish(self, refs: Iterable[tuple[SlotRef, int, int]], hold_s: float = 0.0) -> list[bool]:
        """Publish written slots: (ref, checksum, nbytes) each. False for a slot whose write lease
        ran out and was taken over (its data may be torn: it stays unpublished)."""
        items = list(refs)
        if not items:
            return []
        slots = np.array([r.slot for r, _, _ in items], dtype=np.int64)
        seqs = np.array([r.seq for r, _, _ in items], dtype=np.uint64)
        with self._file_lock():
            c = self._cols
            now = time.time()
            ok = (c["seq"][slots] == seqs) & (c["state"][slots] == WRITING)
            mine = slots[ok]
            c["checksum"][mine] = np.array([int(chk) for _, chk, _ in items],
                                           dtype=np.uint64)[ok]
            c["nbytes"][mine] = np.array([n for _, _, n in items], dtype=np.uint64)[ok]
            c["hold_until"][mine] = now + hold_s
            c["last_use"][mine] = now
            c["state"][mine] = READY  # last: readers see a complete entry
        return ok.tolist()

    def abandon(self, refs: Iterable[SlotRef]) -> None:
        """Give back reserved slots that will not be published."""
        with self._file_lock():
            c = self._cols
            for ref in refs:
                if c["seq"][ref.slot] == ref.seq and c["state"][ref.slot] == WRITING:
                    c["state"][ref.slot] = FREE

    # -- reading ---------------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes], hints: Sequence[SlotRef | None] | None = None,
            read_lease_s: float = DEFAULT_READ_LEASE_S) -> list[PinnedSlot | None]:
        """Pin the published slot of each key for reading (None: not published). A hint (a slot
        and generation from the writer) is used only if that slot still holds exactly this key."""
        with self._file_lock():
            c = self._cols
            now = time.time()
            slots = np.full(len(keys), -1, dtype=np.int64)
            for i, hint in enumerate(hints or ()):
                if (i < len(keys) and hint is not None and 0 <= hint.slot < self.num_slots
                        and c["seq"][hint.slot] == hint.seq and c["state"][hint.slot] == READY
                        and c["key"][hint.slot].tobytes() == keys[i]):
                    slots[i] = hint.slot
            missing = np.flatnonzero(slots < 0)
            if missing.size:
                slots[missing] = self._find_many([keys[i] for i in missing])
            got = slots[slots >= 0]
            stale = got[(c["readers"][got] > 0) & (c["read_until"][got] <= now)]
            c["readers"][stale] = 0  # earlier pins whose lease ran out: dead readers
            np.add.at(c["readers"], got, 1)
            c["read_until"][got] = np.maximum(c["read_until"][got], now + read_lease_s)
            c["last_use"][got] = now
            seqs, sums, sizes = c["seq"][got], c["checksum"][got], c["nbytes"][got]
        it = iter(zip(got.tolist(), seqs.tolist(), sums.tolist(), sizes.tolist()))
        return [PinnedSlot(*next(it)) if s >= 0 else None for s in slots.tolist()]

    def read(self, pinned: PinnedSlot) -> np.ndarray:
        """A view of a pinned slot's bytes (copy out of it before unpinning)."""
        return self.data[pinned.slot, :pinned.nbytes]

    def read_many(self, pinned: Sequence[PinnedSlot], out: np.ndarray) -> list[bool]:
        """Copy pinned slots into rows of `out` ([n, nbytes] uint8), one copy per run of
        consecutive slots; True for each copy whose checksum matches its pin's (always True in
        a pool without checksums). Unpin afterwards: that checks the generations."""
        sums = copy_runs(self.data, [p.slot for p in pinned], out, range(len(pinned)),
                         sum_source=False if self.checksums else None)
        if not self.checksums:
            return [True] * len(pinned)
        return [int(s) == p.checksum for s, p in zip(sums, pinned)]

    def unpin(self, pinned: Iterable[PinnedSlot]) -> list[bool]:
        """Release pins; True where the slot kept its generation throughout (the copy is good)."""
        items = list(pinned)
        if not items:
            return []
        slots = np.array([p.slot for p in items], dtype=np.int64)
        seqs = np.array([p.seq for p in items], dtype=np.uint64)
        with self._file_lock():
            c = self._cols
            same = (c["seq"][slots] == seqs) & (c["state"][slots] == READY)
            held = slots[same & (c["readers"][slots] > 0)]
            np.subtract.at(c["readers"], held, 1)
        return same.tolist()

    def release_hold(self, refs: Iterable[SlotRef]) -> None:
        """End the publisher's hold early (the decode has what it needed)."""
        with self._file_lock():
            c = self._cols
            for ref in refs:
                if c["seq"][ref.slot] == ref.seq:
                    c["hold_until"][ref.slot] = 0.0

    # -- inspection ------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        with self._file_lock():
            c = self._cols
            now = time.time()
            state = c["state"]
            return PoolStats(
                num_slots=self.num_slots,
                free=int((state == FREE).sum()),
                writing=int((state == WRITING).sum()),
                ready=int((state == READY).sum()),
                pinned=int(((c["readers"] > 0) & (c["read_until"] > now)).sum()),
                held=int(((state == READY) & (c["hold_until"] > now)).sum()),
            )


def remove_pool(path: str) -> None:
    """Delete a pool file (not a device). Processes that still map it keep their mapping."""
    try:
        if not stat.S_ISCHR(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


# Copy this much, then sum it. Smaller chunks would be summed from cache, but copies out of the
# shared mapping ran at half speed in 256 KiB pieces here and at full speed from 1 MiB up.
CHECKSUM_CHUNK_BYTES = 2 * 1024 * 1024


def copy_runs(src: np.ndarray, src_rows: Sequence[int], dst: np.ndarray,
              dst_rows: Sequence[int], sum_source: bool | None) -> np.ndarray:
    """Copy src rows to dst rows (uint8, equal widths up to dst's), one np.copyto per run where
    both sides step by one (split into cache-sized chunks), and sum each copied row right after
    its copy: from the source (a writer's checksum), the destination (what a reader got), or
    not at all (None: zeros)."""
    src_rows, dst_rows = list(src_rows), list(dst_rows)
    width = src.shape[1] if sum_source else dst.shape[1]
    sums = np.zeros(len(src_rows), dtype=np.uint64)
    per_chunk = max(1, CHECKSUM_CHUNK_BYTES // max(1, width))
    start = 0
    for i in range(1, len(src_rows) + 1):
        if (i < len(src_rows) and src_rows[i] == src_rows[i - 1] + 1
                and dst_rows[i] == dst_rows[i - 1] + 1 and i - start < per_chunk):
            continue
        s0, d0, n = src_rows[start], dst_rows[start], i - start
        np.copyto(dst[d0:d0 + n, :width], src[s0:s0 + n, :width])
        if sum_source is not None:
            summed = src[s0:s0 + n, :width] if sum_source else dst[d0:d0 + n, :width]
            sums[start:i] = row_checksums(summed)
        start = i
    return sums
