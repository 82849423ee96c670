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
- A writer reserves a slot (state WRITING, a write lease, a new generation), copies the data,
  then publishes it (state READY, checksum) in a second, later header change that checks the
  generation: data first, index entry second. A writer killed mid-copy never publishes; its
  lease runs out and the slot is reclaimed. A slot that is freed (reclaimed, abandoned,
  discarded) gets a new generation too: no reference to it stays valid.
- A writer copies only inside a fence (`writing`): a shared OFD lock on each of its slots, under
  which it checks the slots still hold its generation. A reservation whose lease ran out is
  reused only once `reserve` gets that slot's exclusive lock (the writer is not copying: dead, or
  stalled between copies, and its next fence sees the slot is gone); if the writer holds its
  fence, it is alive and copying, and its lease is renewed instead. So a copy into a slot happens
  only while the slot is the copier's reservation: a writer that stalled past its lease never
  changes another writer's published block, with or without checksums.
- A reader pins a READY slot (reader count and a read lease), copies, then unpins. Unpinning
  reports whether the slot kept its generation (`seq`) throughout: a slot is only reused once
  it has no live pins, so a changed generation means the copy may be torn and must not be used.
  A reader killed mid-copy leaves its pin behind only until its read lease runs out.
- A published block may carry a hold (`hold_until`): the prefill's promise to the decode that
  the block stays until then, set at publish, or by `extend_hold` for a block the prefill found
  already published. Eviction is LRU over slots with no hold, no live pin, and no live
  write lease.
- Checksums (a 64-bit sum of the slot's words, taken by the writer from its source data) let a
  reader check the bytes themselves: what keeps the pool correct on memory that is not cache
  coherent across hosts, where a generation check alone cannot see stale lines. They are taken
  in the same pass as the copy (shm_pool_kernels.copy_rows); a pool is created with or without
  them (the connectors' default, `checksums=None`: with them on a DAX device, without on a file).
- Header work is batched and compiled: a call handles a request's blocks as arrays (`SlotRefs`,
  `PinnedSlots`) in one call into a numba kernel (shm_pool_kernels.py), not per block.

Who may open the region (the pool holds every prompt's KV, so it is as private as the prompts):
- A file is created with O_EXCL|O_NOFOLLOW, mode 0600 (0660 and the configured group with
  `group`), and its memory reserved at once (posix_fallocate: a full /dev/shm is an error here, not
  a SIGBUS on first touch). An existing file is used only if it is a regular file with one link,
  owned by this user with no group or other access, or in the configured group with no other
  access: a file another local user planted at the path, or a symbolic link, is refused. A DAX
  device (a character device, which only root can make) is used as its node's permissions allow.
- The superblock (magic, version, flags, geometry) is checked against the region's size before
  any header column is mapped: a truncated or corrupt region is a PoolError naming the path,
  never a ValueError or a SIGBUS.
- `readonly` handles (the router's view, pd-pool) open the file O_RDONLY and map it read-only.

Removing pools: `remove_when_unused` unlinks the file when the last process that maps it
read-write closes its handle; `pd-pool` (pool_admin.py) lists pools and removes idle ones. A
read-write handle holds a shared OFD lock on the file's byte IN_USE_BYTE while it is open, which
removal checks besides /proc/PID/maps: containers of one pod share /dev/shm but not PIDs, so an
engine in another container is not in this /proc, yet its lock is seen. An
opener that finds the path unlinked or replaced under it (between its open and its lock) opens
again, so engines never settle on a pool that was just removed.

Engine-agnostic: numpy, numba and the standard library only.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import mmap
import os
import stat
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from pd_plugins.transfer import shm_pool_kernels as kernels
from pd_plugins.transfer.pool_mappers import writable_mappers
from pd_plugins.transfer.shm_pool_kernels import FREE, KEY_BYTES, READY, WRITING  # one definition

MAGIC = b"PDSHMPL1"
FORMAT_VERSION = 2            # 2: header columns start on cache-line boundaries
SUPERBLOCK_BYTES = 4096
LAYOUT_BYTES = 2048           # the engine's KV layout description, checked on every open
SLOT_ALIGN = 64               # slot size granularity (a cache line; checksums read u64 words)
PAGE = 4096
MADV_POPULATE_WRITE = 23      # linux/mman.h

FLAG_CHECKSUMS = 1            # writers sum every slot, readers check the sums

DEFAULT_WRITE_LEASE_S = 30.0  # a writer that has not published by then is presumed dead
DEFAULT_READ_LEASE_S = 30.0   # likewise for a reader that has not unpinned


class PoolError(RuntimeError):
    """The region cannot serve as this pool (wrong layout, too small, not a pool, not trusted)."""


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


def checksums_by_default(path: str) -> bool:
    """Checksums where memory may not be coherent: on for a DAX device (CXL memory shared by
    hosts), off for a file (one host, where the generation check alone is exact)."""
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a planted FIFO cannot hang us


def resolve_group(group: str | int | None) -> int | None:
    """A group name or id (the `group` option) as a gid."""
    if group is None or group == "":
        return None
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise PoolError(f"KV pool group {group!r} does not exist") from None


def check_trusted(path: str, st: os.stat_result, gid: int | None) -> None:
    """Refuse a region that someone else could read or write: see the module docstring."""
    if stat.S_ISCHR(st.st_mode):
        return  # a DAX device node: only root makes those, and its permissions say who opens it
    if not stat.S_ISREG(st.st_mode):
        raise PoolError(f"KV pool {path} is not a regular file or a DAX device: refused")
    mine = st.st_uid == os.geteuid() and not st.st_mode & 0o077
    shared = gid is not None and st.st_gid == gid and not st.st_mode & 0o007
    if not (mine or shared):
        allowed = ("owned by this user (uid %d) with mode 0600" % os.geteuid()
                   + ("" if gid is None else f", or in group {gid} with no access for others"))
        raise PoolError(
            f"KV pool {path} is owned by uid {st.st_uid}, group {st.st_gid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}: refused (another local user may have made it, or "
            f"may read it); a pool must be {allowed}. Remove it, or give another path")
    if st.st_nlink != 1:
        raise PoolError(f"KV pool {path} has {st.st_nlink} hard links: refused")


def _open_region(path: str, *, create: bool, readonly: bool, gid: int | None) -> tuple[int, bool]:
    """(fd, whether this call created the file): a new file made exclusively, or an existing
    region that passes check_trusted."""
    access = os.O_RDONLY if readonly else os.O_RDWR
    if create:
        mode = 0o600 if gid is None else 0o660
        try:  # created for this user alone: the pool's group gets access only once it owns it
            fd = os.open(path, access | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
        except FileExistsError:
            pass  # someone made it: open it as an existing region (checked)
        except OSError as exc:
            raise PoolError(f"cannot create KV pool {path}: {exc.strerror}") from exc
        else:
            try:
                if gid is not None:
                    os.fchown(fd, -1, gid)
                os.fchmod(fd, mode)  # what the umask took away, and the group's bits last
            except OSError as exc:
                _unlink_if_same(path, fd)
                os.close(fd)
                raise PoolError(f"cannot give KV pool {path} mode {mode:04o} and group {gid}: "
                                f"{exc.strerror}") from exc
            return fd, True
    try:
        fd = os.open(path, access | _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PoolError(f"KV pool {path} is a symbolic link: refused (a link in a shared "
                            "directory can point anywhere; give the real path)") from exc
        raise PoolError(f"cannot open KV pool {path}: {exc.strerror}") from exc
    try:
        check_trusted(path, os.fstat(fd), gid)
    except BaseException:
        os.close(fd)
        raise
    return fd, False


def _same_file(path: str, fd: int) -> bool:
    """Whether `path` still names the file open at `fd` (not unlinked or replaced)."""
    try:
        a, b = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _unlink_if_same(path: str, fd: int) -> bool:
    if _same_file(path, fd) and not stat.S_ISCHR(os.fstat(fd).st_mode):
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            pass
    return False


# Slot fences: OFD byte-range locks (kept per open file description, so per thread here, and
# dropped by the kernel when their holder dies) on byte SLOT_LOCK_BASE + slot of the region's file,
# far past its data. A writer holds a shared lock on its slots while it copies into them; taking
# over a reservation whose lease ran out needs the exclusive lock (ShmKVPool.writing, _reclaim).
SLOT_LOCK_BASE = 1 << 62
# Byte the read-write handles hold a shared OFD lock on while open (not `flock`: that is the pool's
# header lock, and one open file description holds one flock at a time).
IN_USE_BYTE = SLOT_LOCK_BASE - 1
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux (l_pid 0, as OFD locks need)


def _range_lock(fd: int, kind: int, start: int, length: int) -> bool:
    """Take (F_RDLCK, F_WRLCK) or drop (F_UNLCK) an OFD lock without waiting; False: held by
    someone else."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def in_use_elsewhere(fd: int) -> bool:
    """Whether a read-write handle on another open file description than `fd` has the pool
    open, in any PID namespace (its in-use lock). Ask under the pool's lock: openers take their
    in-use lock under it, so the answer holds until it is released. A test (F_OFD_GETLK), not a
    lock: it works on pd-pool's read-only descriptor."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, IN_USE_BYTE,
                                                          1, 0))
    return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _column_bytes(dt: str, width: int, num_slots: int) -> int:
    """A column's size, padded so the next one starts on a cache line (aligned columns keep
    numpy on its fast paths: an unaligned u8 column searched ~4x slower)."""
    return _round_up(np.dtype(dt).itemsize * width * num_slots, SLOT_ALIGN)


def _headers_bytes(num_slots: int) -> int:
    return sum(_column_bytes(dt, width, num_slots) for _, dt, width in _COLUMNS)


def pool_geometry(region_bytes: int, slot_bytes: int) -> tuple[int, int, int]:
    """(slot size rounded up, number of slots, data offset) that fit in a region."""
    slot_bytes = _round_up(slot_bytes, SLOT_ALIGN)
    per_slot = slot_bytes + sum(np.dtype(dt).itemsize * width for _, dt, width in _COLUMNS)
    num_slots = max(0, (region_bytes - SUPERBLOCK_BYTES - PAGE) // per_slot)
    data_offset = _round_up(SUPERBLOCK_BYTES + _headers_bytes(num_slots), PAGE)
    while num_slots and data_offset + num_slots * slot_bytes > region_bytes:
        num_slots -= 1
        data_offset = _round_up(SUPERBLOCK_BYTES + _headers_bytes(num_slots), PAGE)
    return slot_bytes, num_slots, data_offset


class SlotRef(NamedTuple):  # a NamedTuple: batches build thousands of these per call
    """A slot at one generation: what a reservation, a lookup or a pin refers to."""

    slot: int
    seq: int


class PinnedSlot(NamedTuple):
    slot: int
    seq: int
    checksum: int
    nbytes: int


class _ArrayBatch(Sequence):
    """A batch held as arrays that compares and prints as the list of its items."""

    __slots__ = ()

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, _ArrayBatch)) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


class SlotRefs(_ArrayBatch):
    """One call's slots as arrays (slot -1: none for that key), which the batched calls use as
    they are: no Python object per block on the hot path. Indexing gives a SlotRef or None."""

    __slots__ = ("slots", "seqs")

    def __init__(self, slots: np.ndarray, seqs: np.ndarray) -> None:
        self.slots, self.seqs = slots, seqs

    @classmethod
    def of(cls, refs: Iterable[SlotRef | None]) -> SlotRefs:
        if isinstance(refs, SlotRefs):
            return refs
        pairs = [(-1, 0) if r is None else (r.slot, r.seq) for r in refs]
        return cls(np.array([p[0] for p in pairs], dtype=np.int64),
                   np.array([p[1] for p in pairs], dtype=np.uint64))

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return SlotRefs(self.slots[i], self.seqs[i])
        slot = int(self.slots[i])
        return SlotRef(slot, int(self.seqs[i])) if slot >= 0 else None

    def __iter__(self):
        return iter([SlotRef(s, q) if s >= 0 else None
                     for s, q in zip(self.slots.tolist(), self.seqs.tolist())])

    def present(self) -> SlotRefs:
        """Only the keys that have a slot."""
        keep = self.slots >= 0
        return SlotRefs(self.slots[keep], self.seqs[keep])


class PinnedSlots(_ArrayBatch):
    """One pin call's result as arrays (slot -1: not published); indexing gives a PinnedSlot or
    None. `read_many` and `unpin` take it as it is."""

    __slots__ = ("slots", "seqs", "checksums", "nbytes")

    def __init__(self, slots: np.ndarray, seqs: np.ndarray, checksums: np.ndarray,
                 nbytes: np.ndarray) -> None:
        self.slots, self.seqs, self.checksums, self.nbytes = slots, seqs, checksums, nbytes

    @classmethod
    def of(cls, pinned: Iterable[PinnedSlot | None]) -> PinnedSlots:
        if isinstance(pinned, PinnedSlots):
            return pinned
        rows = [(-1, 0, 0, 0) if p is None else tuple(p) for p in pinned]
        return cls(*(np.array([r[k] for r in rows], dtype=dt) for k, dt in
                     enumerate((np.int64, np.uint64, np.uint64, np.uint64))))

    def __len__(self) -> int:
        return len(self.slots)

    def _take(self, index) -> PinnedSlots:
        return PinnedSlots(self.slots[index], self.seqs[index], self.checksums[index],
                           self.nbytes[index])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._take(i)
        slot = int(self.slots[i])
        return (PinnedSlot(slot, int(self.seqs[i]), int(self.checksums[i]), int(self.nbytes[i]))
                if slot >= 0 else None)

    def __iter__(self):
        return iter([PinnedSlot(*row) if row[0] >= 0 else None for row in zip(
            self.slots.tolist(), self.seqs.tolist(), self.checksums.tolist(),
            self.nbytes.tolist())])

    def present(self) -> PinnedSlots:
        """Only the keys that were pinned."""
        return self._take(self.slots >= 0)


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
                 prefault: bool = True, checksums: bool | None = True, readonly: bool = False,
                 group: str | int | None = None, remove_when_unused: bool = False) -> None:
        """Map the pool at `path`, creating it if it does not exist (and `create`).

        `slot_bytes` and `layout` (a description of the engine's KV block: model, dtype, shapes)
        must match what the pool was created with: a pool serves one KV layout. Both None
        attaches to an existing pool whatever its layout (`attach`).
        `size_bytes` is the region size to create (a DAX device has its own size).
        `checksums` is the pool's setting when this call creates it (None: `checksums_by_default`
        for the path); an existing pool keeps its own (`self.checksums`): every writer and reader
        of a pool must agree.
        `readonly`: map it read-only (header and data); only lookups and inspection work.
        `group`: a group (name or id) whose members share the pool: a file is created 0660 in it,
        and an existing one may belong to it (default: this user's alone, 0600).
        `remove_when_unused`: `close` unlinks the file when no other process maps it read-write.
        Every way the region can be unfit (untrusted, truncated, corrupt, another layout) is a
        PoolError that names the path.
        """
        if (slot_bytes is None) != (layout is None) or (layout is None and create):
            raise ValueError("give slot_bytes and layout, or neither with create=False")
        if readonly and create:
            raise ValueError("a read-only handle cannot create a pool: give create=False")
        layout_b = layout.encode() if layout is not None else None
        if layout_b is not None and len(layout_b) > LAYOUT_BYTES:
            raise PoolError(f"layout description longer than {LAYOUT_BYTES} bytes")
        self.path = path
        self.readonly = readonly
        self.remove_when_unused = remove_when_unused and not readonly
        self._gid = resolve_group(group)
        self._thread_lock = threading.Lock()
        self._local = threading.local()  # each thread's own descriptor for slot fences
        self._fence_fds: list[int] = []
        self._cols = None
        if checksums is None:
            checksums = checksums_by_default(path)
        for _ in range(5):
            self._fd, created = _open_region(path, create=create, readonly=readonly,
                                             gid=self._gid)
            try:
                with self._file_lock():
                    # pd-pool or a last user may have unlinked it between our open and our lock
                    replaced = not _same_file(path, self._fd)
                    if not replaced:
                        self._map(size_bytes, slot_bytes, layout_b, create, checksums)
                        if not readonly and not self._device:  # see in_use_elsewhere
                            _range_lock(self._fd, fcntl.F_RDLCK, IN_USE_BYTE, 1)
            except BaseException:
                if created:  # ours alone so far: leave no half-made pool behind
                    _unlink_if_same(path, self._fd)
                self._unmap()
                os.close(self._fd)
                raise
            if not replaced:
                break
            self._unmap()
            os.close(self._fd)
        else:
            raise PoolError(f"KV pool {path} was removed or replaced each time it was opened")
        if not readonly:
            self._takeover_fd = self._reopen()
            if prefault:
                self._prefault()
            kernels.warm_up()

    # -- opening -------------------------------------------------------------------------------
    def _region_size(self, st: os.stat_result) -> int:
        if stat.S_ISCHR(st.st_mode):  # a DAX device: its size is in sysfs
            major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
            try:
                with open(f"/sys/dev/char/{major}:{minor}/size") as f:
                    return int(f.read())
            except (OSError, ValueError) as exc:
                raise PoolError(f"KV pool {self.path} is a character device without a DAX size "
                                f"({exc}): not a DAX device?") from exc
        return st.st_size

    @classmethod
    def attach(cls, path: str, prefault: bool = False, readonly: bool = False,
               group: str | int | None = None) -> ShmKVPool:
        """Map an existing pool, whatever KV layout it serves (tools, tests, the router)."""
        return cls(path, slot_bytes=None, layout=None, create=False, prefault=prefault,
                   readonly=readonly, group=group)

    def _map(self, size_bytes: int | None, slot_bytes: int | None, layout: bytes | None,
             create: bool, checksums: bool) -> None:
        st = os.fstat(self._fd)
        self._device = stat.S_ISCHR(st.st_mode)
        size = self._region_size(st)
        if size == 0:
            if not create or not size_bytes:
                raise PoolError(f"KV pool {self.path} is empty and no pool size was given "
                                "(no engine has made it yet, or one died making it)")
            self._allocate(size_bytes)
            size = size_bytes
        if size < SUPERBLOCK_BYTES + PAGE:
            raise PoolError(f"KV pool {self.path} is {size} bytes: too small for a pool's header "
                            "(a truncated file?)")
        prot = mmap.PROT_READ | (0 if self.readonly else mmap.PROT_WRITE)
        try:
            self._mm = mmap.mmap(self._fd, size, mmap.MAP_SHARED, prot)
        except OSError as exc:
            raise PoolError(f"cannot map KV pool {self.path}: {exc.strerror}") from exc
        sb = np.frombuffer(self._mm, dtype=_SUPER_DTYPE, count=1)[0:1]
        self._super = sb
        # next_seq as a plain one-element view: a structured array's field costs ~5 us a touch
        self._next_seq = np.frombuffer(self._mm, dtype=np.uint64, count=1,
                                       offset=_SUPER_DTYPE.fields["next_seq"][1])
        if sb["magic"][0] != MAGIC:
            # format only a region that was never a pool: a file whose creator died before
            # writing the header (all zeros), or a DAX device this engine was given
            blank = self._mm[:SUPERBLOCK_BYTES].count(0) == SUPERBLOCK_BYTES
            if not (create and (blank or self._device)):
                raise PoolError(f"{self.path} is not a pd-plugins KV pool (no pool header): "
                                "remove it, or give another path")
            self._format(size, slot_bytes, layout, checksums)
        self._check_superblock(size)
        if layout is None:  # attach
            slot_bytes, layout = int(sb["slot_bytes"][0]), bytes(sb["layout"][0])
        want_slot = _round_up(slot_bytes, SLOT_ALIGN)
        try:
            self.layout = layout.decode()
            have_layout = bytes(sb["layout"][0]).decode()
        except UnicodeDecodeError as exc:
            raise PoolError(f"KV pool {self.path} has a corrupt layout description") from exc
        if int(sb["slot_bytes"][0]) != want_slot or bytes(sb["layout"][0]) != layout:
            raise PoolError(
                f"KV pool {self.path} was made for another KV layout: it has "
                f"{int(sb['slot_bytes'][0])}-byte slots for {have_layout!r}, "
                f"this engine needs {want_slot}-byte slots for {self.layout!r}. "
                f"Give each model its own pool path.")
        self.slot_bytes = want_slot
        self.pool_id = bytes(sb["uuid"][0]).hex()  # names this pool in transfer params
        self.checksums = bool(int(sb["flags"][0]) & FLAG_CHECKSUMS)
        self.num_slots = int(sb["num_slots"][0])
        offset = SUPERBLOCK_BYTES
        cols: dict[str, np.ndarray] = {}
        for name, dt, width in _COLUMNS:
            count = self.num_slots * width
            col = np.frombuffer(self._mm, dtype=dt, count=count, offset=offset)
            cols[name] = col.reshape(self.num_slots, width) if width > 1 else col
            offset += _column_bytes(dt, width, self.num_slots)
        self._cols = cols
        data_offset = int(sb["data_offset"][0])
        self.data = np.frombuffer(self._mm, dtype=np.uint8, count=self.num_slots * self.slot_bytes,
                                  offset=data_offset).reshape(self.num_slots, self.slot_bytes)

    def _check_superblock(self, size: int) -> None:
        """Version, flags and geometry against the region's size, before any column is mapped."""
        sb = self._super
        version = int(sb["version"][0])
        if version != FORMAT_VERSION:
            raise PoolError(f"KV pool {self.path} has format {version}, this "
                            f"pd-plugins uses {FORMAT_VERSION}: remove it (or give another path)")
        flags = int(sb["flags"][0])
        if flags & ~FLAG_CHECKSUMS:
            raise PoolError(f"KV pool {self.path} has unknown flags {flags:#x}: a corrupt header")
        slot_bytes, num_slots = int(sb["slot_bytes"][0]), int(sb["num_slots"][0])
        data_offset = int(sb["data_offset"][0])
        if num_slots == 0:
            raise PoolError(f"KV pool {self.path} is too small for one {slot_bytes}-byte slot")
        need = data_offset + num_slots * slot_bytes
        if (slot_bytes <= 0 or slot_bytes % SLOT_ALIGN
                or data_offset != _round_up(SUPERBLOCK_BYTES + _headers_bytes(num_slots), PAGE)
                or need > size):
            raise PoolError(
                f"KV pool {self.path} is truncated or its header is corrupt: the header says "
                f"{num_slots} slots of {slot_bytes} bytes from offset {data_offset} ({need} bytes), "
                f"the region has {size} bytes. Remove it (pd-pool remove) and an engine makes "
                "it anew")

    def _allocate(self, size: int) -> None:
        """Give a new file its size, its memory reserved now (a full /dev/shm is an error here,
        not a SIGBUS when a page is first touched)."""
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise PoolError(f"cannot allocate {size} bytes for KV pool {self.path}: "
                                f"{exc.strerror}") from exc
            os.ftruncate(self._fd, size)  # a file system without fallocate

    def _format(self, size: int, slot_bytes: int, layout: bytes, checksums: bool) -> None:
        slot_bytes, num_slots, data_offset = pool_geometry(size, slot_bytes)
        self._mm[:data_offset] = bytes(data_offset)
        sb = self._super
        sb["slot_bytes"], sb["num_slots"], sb["data_offset"] = slot_bytes, num_slots, data_offset
        sb["version"], sb["next_seq"], sb["created"] = FORMAT_VERSION, 1, time.time()
        sb["flags"] = FLAG_CHECKSUMS if checksums else 0
        sb["layout"] = layout
        sb["uuid"] = np.frombuffer(os.urandom(16), dtype="V16")[0]
        sb["magic"] = MAGIC  # last: a pool is only a pool once its header is complete

    def _prefault(self) -> None:
        """Map every page now: a first touch inside a copy faults page by page and runs ~8x slower
        (bench/shm_pool_bandwidth.py times a pool's mapping and first pass: docs/benchmarks.md)."""
        try:  # Python names MADV_POPULATE_WRITE from 3.13; Linux has it since 5.14
            self._mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", MADV_POPULATE_WRITE))
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # not "unknown advice": memory ran out (a sparse file)
                raise PoolError(f"cannot populate KV pool {self.path}: {exc.strerror} (is "
                                f"{os.path.dirname(self.path) or '.'} full?)") from exc
            view = np.frombuffer(self._mm, dtype=np.uint8)  # an older kernel: touch every page
            view[::PAGE] = view[::PAGE]

    def _reopen(self) -> int:
        """A second open file description of this region (its own OFD locks)."""
        try:
            return os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:  # no /proc: by path, then make sure it is the same file
            fd = os.open(self.path, os.O_RDWR | _OPEN_FLAGS)
            if (os.fstat(fd).st_ino, os.fstat(fd).st_dev) != (os.fstat(self._fd).st_ino,
                                                              os.fstat(self._fd).st_dev):
                os.close(fd)
                raise PoolError(f"KV pool {self.path} was replaced while in use") from None
            return fd

    def _unmap(self) -> None:
        self._cols, self.data, self._super, self._next_seq = None, None, None, None  # views first
        mm = getattr(self, "_mm", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes with the process
            self._mm = None

    def close(self) -> None:
        if self._cols is None:
            return
        self._unmap()
        with self._thread_lock:
            fds, self._fence_fds = self._fence_fds, []
        if not self.readonly:
            fds.append(self._takeover_fd)
        for fd in fds:
            os.close(fd)
        if self.remove_when_unused:
            self._remove_if_unused()
        # dropped explicitly: a forked child that inherited the descriptor would keep it
        _range_lock(self._fd, fcntl.F_UNLCK, IN_USE_BYTE, 1)
        os.close(self._fd)

    def _remove_if_unused(self) -> None:
        """Unlink the file if no other process maps it read-write, in this PID namespace or
        another (checked under the pool's lock, which openers take before they map and lock: one
        that opened the file before the unlink sees the path gone once it has the lock, and opens
        again)."""
        with self._file_lock():
            _range_lock(self._fd, fcntl.F_UNLCK, IN_USE_BYTE, 1)  # ours first: we are leaving
            if not writable_mappers(os.fstat(self._fd)) and not in_use_elsewhere(self._fd):
                _unlink_if_same(self.path, self._fd)

    def file_id(self) -> tuple[int, int]:
        """(device, inode) of the mapped region: whether its path still names it."""
        st = os.fstat(self._fd)
        return st.st_dev, st.st_ino

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

    def _require_writable(self) -> None:
        if self.readonly:
            raise PoolError(f"KV pool {self.path} is mapped read-only here")

    # -- lookup ----------------------------------------------------------------------------------
    # Each locked call is one kernel call over the batch and the header columns
    # (shm_pool_kernels.py): a lookup is one pass over the slots probing a small table of the
    # batch's keys. What is left in Python per call: the keys as one array, the lock, the result.
    @staticmethod
    def _key_rows(keys: Sequence[bytes]) -> np.ndarray:
        """Keys as one [n, KEY_BYTES] uint8 array."""
        joined = b"".join(keys)
        if len(joined) != KEY_BYTES * len(keys):
            raise ValueError(f"pool keys are {KEY_BYTES} bytes each")
        return np.frombuffer(joined, dtype=np.uint8).reshape(len(keys), KEY_BYTES)

    def lookup(self, keys: Sequence[bytes], writing: bool = False) -> SlotRefs:
        """Where each key is published now (None: not in the pool; `writing`: or being written).
        A hint: pin before reading."""
        rows = self._key_rows(keys)
        slots = np.empty(len(keys), dtype=np.int64)
        with self._file_lock():
            c = self._cols
            kernels.find(c["state"], c["key"], c["key64"], rows, True, writing, slots)
            seqs = c["seq"][np.maximum(slots, 0)]
        return SlotRefs(slots, seqs)

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are published."""
        missing = np.flatnonzero(self.lookup(keys).slots < 0)
        return int(missing[0]) if missing.size else len(keys)

    def published_content_keys(self) -> np.ndarray:
        """The content keys of every published slot, read without the lock (a routing hint)."""
        c = self._cols
        return c["content_key"][c["state"] == READY].copy()

    # -- writing ---------------------------------------------------------------------------------
    def reserve(self, keys: Sequence[bytes], content_keys: Sequence[int] | None = None,
                write_lease_s: float = DEFAULT_WRITE_LEASE_S) -> SlotRefs:
        """Reserve one slot per key to write into. None for a key already published or being
        written by a live writer (nothing to do), or when every slot is in use (pool full).
        Reused slots are free ones first, in slot order (consecutive blocks land in consecutive
        slots and copy as one run), then the least recently used evictable ones."""
        rows = self._key_rows(keys)
        content = (np.asarray(content_keys, dtype=np.int64) if content_keys is not None
                   else _NONE_I64)
        self._require_writable()
        with self._file_lock():
            slots, seqs = self._reserve_locked(rows, content, float(write_lease_s))
        return SlotRefs(slots, seqs)

    def _reserve_locked(self, rows: np.ndarray, content: np.ndarray, lease_s: float
                        ) -> tuple[np.ndarray, np.ndarray]:
        c = self._cols
        now = time.time()

        def reserve(rows, content):
            return kernels.reserve(
                c["state"], c["key"], c["key64"], c["content_key"], c["seq"], c["write_until"],
                c["hold_until"], c["readers"], c["read_until"], c["last_use"], c["writer_pid"],
                self._next_seq, rows, content, now, lease_s, os.getpid())

        slots, seqs, expired = reserve(rows, content)
        if expired.size and self._reclaim(expired, now, lease_s) and (slots < 0).any():
            again = np.flatnonzero(slots < 0)  # keys left without a slot: try the freed ones
            retry = rows[again]
            retry.flags.writeable = False  # as keys always are: the kernel compiled for that
            slots[again], seqs[again], _ = reserve(retry,
                                                   content[again] if content.size else content)
        return slots, seqs

    def _reclaim(self, expired: np.ndarray, now: float, lease_s: float) -> int:
        """Reservations whose write lease ran out (under the pool's lock): free each one whose
        writer is not copying into it (dead, or stalled between copies: its next copy and its
        publish see the slot is no longer its own), renew the lease of each one whose writer is
        copying now (alive: it holds the slot's fence). Returns how many were freed."""
        c, fd = self._cols, self._takeover_fd
        idle = np.array([_range_lock(fd, fcntl.F_WRLCK, SLOT_LOCK_BASE + s, 1)
                         for s in expired.tolist()], dtype=bool)
        try:
            self._free_locked(expired[idle])
            c["write_until"][expired[~idle]] = now + lease_s
        finally:
            _range_lock(fd, fcntl.F_UNLCK, SLOT_LOCK_BASE, self.num_slots)
        return int(idle.sum())

    def _free_locked(self, slots: np.ndarray) -> None:
        """Free slots (under the pool's lock) with a new generation each: a freed slot keeps no
        generation a reference holds, so a writer's unlocked fence check (generation, then state)
        cannot pass on a slot that another writer reserved between its two reads."""
        c, seq = self._cols, self._next_seq[0]
        self._next_seq[0] = seq + np.uint64(len(slots))
        c["seq"][slots] = seq + np.arange(len(slots), dtype=np.uint64)
        c["state"][slots] = FREE

    @contextmanager
    def writing(self, refs: Sequence[SlotRef] | SlotRefs) -> Iterator[np.ndarray]:
        """Fence a copy into reserved slots: yields a bool per ref, True where the slot is still
        this writer's reservation (same generation, still WRITING). Copy into those slots only,
        inside the block: until it ends nobody can take them over, even once their write lease
        has run out (a reserve that meets them renews their lease instead). A slot that is not
        this writer's any more (its lease ran out and it was taken over or freed) is left alone:
        a writer that stalled past its lease never changes another writer's block. Blocks may
        overlap in time (one per batch of a step, say) but not in slots; a block may end on
        another thread than it began."""
        self._require_writable()
        refs = SlotRefs.of(refs)
        fd = self._fence_fd()
        slots = refs.slots
        locked, ranges = self._fence_slots(fd, slots, self.num_slots)
        try:
            c = self._cols
            yield locked & (c["seq"][slots] == refs.seqs) & (c["state"][slots] == WRITING)
        finally:
            for start, length in ranges:  # these only: blocks of one thread may overlap in time
                _range_lock(fd, fcntl.F_UNLCK, SLOT_LOCK_BASE + start, length)

    @staticmethod
    def _fence_slots(fd: int, slots: np.ndarray, num_slots: int
                     ) -> tuple[np.ndarray | bool, list[tuple[int, int]]]:
        """Shared fences on slots: one lock call when they are one run of consecutive slots
        (nearly always: a batch is reserved in consecutive slots), else one per slot. Returns
        where a fence was taken (False: a reserve is taking that slot over right now) and the
        (first slot, count) ranges locked."""
        n = len(slots)
        if not n:
            return True, []
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= num_slots:
            raise ValueError("slots out of range: fence only what reserve handed out")
        if high - low == n - 1 and _range_lock(fd, fcntl.F_RDLCK, SLOT_LOCK_BASE + low, n):
            return True, [(low, n)]
        got = np.zeros(n, dtype=bool)
        for j, slot in enumerate(slots.tolist()):
            got[j] = _range_lock(fd, fcntl.F_RDLCK, SLOT_LOCK_BASE + slot, 1)
        return got, [(slot, 1) for slot, ok in zip(slots.tolist(), got.tolist()) if ok]

    def _fence_fd(self) -> int:
        """This thread's own open file description: OFD locks of one description do not
        conflict, so threads (and the takeover in `reserve`) each need their own."""
        fd = getattr(self._local, "fd", None)
        if fd is None:
            fd = self._local.fd = self._reopen()
            with self._thread_lock:
                self._fence_fds.append(fd)
        return fd

    def write(self, ref: SlotRef, data: np.ndarray) -> int:
        """Copy `data` (any contiguous array) into a reserved slot; returns its checksum (0 in
        a pool without checksums). Nothing is copied into a slot that is no longer this
        writer's (its lease ran out and it was taken over): `publish` then says False."""
        src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if src.size > self.slot_bytes:
            raise ValueError(f"{src.size} bytes do not fit a {self.slot_bytes}-byte slot")
        with self.writing([ref]) as owned:
            if owned[0]:
                self.data[ref.slot, :src.size] = src
        return checksum(src) if self.checksums else 0

    def write_many(self, refs: Sequence[SlotRef] | SlotRefs, rows: np.ndarray) -> np.ndarray:
        """Copy rows ([n, nbytes] uint8, nbytes a multiple of 8) into reserved slots (all
        present); returns each row's checksum (zeros without checksums). Rows whose slot is no
        longer this writer's are not copied (`publish` says False for them)."""
        refs = SlotRefs.of(refs)
        with self.writing(refs) as owned:
            if owned.all():
                return copy_runs(rows, range(len(refs)), self.data, refs.slots,
                                 sum_source=True if self.checksums else None)
            sums = np.zeros(len(refs), dtype=np.uint64)
            keep = np.flatnonzero(owned)
            sums[keep] = copy_runs(rows, keep, self.data, refs.slots[keep],
                                   sum_source=True if self.checksums else None)
            return sums

    def publish(self, refs: Iterable[tuple[SlotRef, int, int]], hold_s: float = 0.0) -> list[bool]:
        """Publish written slots: (ref, checksum, nbytes) each. False for a slot whose write lease
        ran out and was taken over (its data may be torn: it stays unpublished)."""
        items = list(refs)
        return self.publish_many(SlotRefs.of([r for r, _, _ in items]),
                                 np.array([int(chk) for _, chk, _ in items], dtype=np.uint64),
                                 np.array([n for _, _, n in items], dtype=np.uint64),
                                 hold_s).tolist()

    def publish_many(self, refs: SlotRefs, checksums: np.ndarray, nbytes: int | np.ndarray,
                     hold_s: float = 0.0) -> np.ndarray:
        """`publish` for a batch (all present) as arrays: a bool array, True where published."""
        self._require_writable()
        slots, seqs = refs.slots, refs.seqs
        if not slots.size:
            return np.zeros(0, dtype=bool)
        sums = np.asarray(checksums, dtype=np.uint64)
        sizes = np.asarray(nbytes, dtype=np.uint64).reshape(-1)  # one per slot, or one for all
        with self._file_lock():
            c = self._cols
            return kernels.publish(c["state"], c["seq"], c["checksum"], c["nbytes"],
                                   c["hold_until"], c["last_use"], slots, seqs, sums, sizes,
                                   time.time(), float(hold_s))

    def abandon(self, refs: Iterable[SlotRef]) -> None:
        """Give back reserved slots that will not be published."""
        self._require_writable()
        with self._file_lock():
            c = self._cols
            self._free_locked(np.array([ref.slot for ref in refs if c["seq"][ref.slot] == ref.seq
                                        and c["state"][ref.slot] == WRITING], dtype=np.int64))

    # -- reading ---------------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes], hints: Sequence[SlotRef | None] | None = None,
            read_lease_s: float = DEFAULT_READ_LEASE_S) -> PinnedSlots:
        """Pin the published slot of each key for reading (None: not published). A hint (a slot
        and generation from the writer) is used only if that slot still holds exactly this key."""
        rows = self._key_rows(keys)
        hint_slots, hint_seqs = self._hint_arrays(hints)
        self._require_writable()
        with self._file_lock():
            c = self._cols
            return PinnedSlots(*kernels.pin(
                c["state"], c["key"], c["key64"], c["seq"], c["checksum"], c["nbytes"],
                c["readers"], c["read_until"], c["last_use"], rows, hint_slots, hint_seqs,
                time.time(), float(read_lease_s)))

    @staticmethod
    def _hint_arrays(hints: Sequence[SlotRef | None] | None) -> tuple[np.ndarray, np.ndarray]:
        """(slots, generations) of the hints: slot -1 for a missing one (the kernel checks the
        range and the slot's key itself, and takes keys past the hints' end as unhinted)."""
        if isinstance(hints, SlotRefs):
            return hints.slots, hints.seqs
        if not hints:
            return _NONE_I64, _NONE_U64
        # a hint comes from a peer's kv_transfer_params: one out of the arrays' range is missing
        pairs = [(h.slot, h.seq) if h is not None and 0 <= h.slot < 1 << 63 and 0 <= h.seq < 1 << 64
                 else (-1, 0) for h in hints]
        return (np.array([p[0] for p in pairs], dtype=np.int64),
                np.array([p[1] for p in pairs], dtype=np.uint64))

    def read(self, pinned: PinnedSlot) -> np.ndarray:
        """A view of a pinned slot's bytes (copy out of it before unpinning)."""
        return self.data[pinned.slot, :pinned.nbytes]

    def read_many(self, pinned: Sequence[PinnedSlot] | PinnedSlots, out: np.ndarray) -> list[bool]:
        """Copy pinned slots (all present) into rows of `out` ([n, nbytes] uint8); True for each
        copy whose checksum matches its pin's (always True in a pool without checksums). Unpin
        afterwards: that checks the generations."""
        pinned = PinnedSlots.of(pinned)
        sums = copy_runs(self.data, pinned.slots, out, range(len(pinned)),
                         sum_source=False if self.checksums else None)
        if not self.checksums:
            return [True] * len(pinned)
        return (sums == pinned.checksums).tolist()

    def unpin(self, pinned: Iterable[PinnedSlot] | PinnedSlots) -> list[bool]:
        """Release pins (all present); True where the slot kept its generation throughout (the
        copy is good)."""
        self._require_writable()
        pinned = PinnedSlots.of(pinned)
        if not len(pinned):
            return []
        with self._file_lock():
            c = self._cols
            same = kernels.unpin(c["state"], c["seq"], c["readers"], pinned.slots, pinned.seqs)
        return same.tolist()

    def reuse_pinned(self, pinned: PinnedSlot, data: np.ndarray | None = None) -> None:
        """Fault injection only (transfer/kv_faults.py `reuse`): do to a pinned slot what a reuse
        between pin and copy would (the pool never allows one while a pin is live): a new
        generation, and with `data` another block's bytes and their checksum in the header. The
        reader's `unpin` must then report the copy torn (and `read_many` its sum wrong)."""
        self._require_writable()
        with self._file_lock():
            c, seq = self._cols, self._next_seq[0]
            self._next_seq[0] = seq + np.uint64(1)
            c["seq"][pinned.slot] = seq
            if data is not None:
                data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
                self.data[pinned.slot, :data.size] = data
                c["checksum"][pinned.slot] = checksum(data) if self.checksums else 0

    def discard(self, pinned: Iterable[PinnedSlot] | PinnedSlots) -> int:
        """Drop published slots whose bytes failed their checksum (after `unpin`), so that no
        later reader loads them again (a writer skips keys the pool has: the bad copy would stay
        until evicted). A slot is dropped only while it holds the pinned generation, is READY
        and has no live pin (another reader's copy fails the same way; that reader drops it).
        Returns how many were dropped."""
        self._require_writable()
        pinned = PinnedSlots.of(pinned)
        with self._file_lock():
            c, now = self._cols, time.time()
            drop = np.unique(np.array(
                [slot for slot, seq in zip(pinned.slots.tolist(), pinned.seqs.tolist())
                 if c["seq"][slot] == seq and c["state"][slot] == READY
                 and not (c["readers"][slot] > 0 and c["read_until"][slot] > now)], dtype=np.int64))
            c["hold_until"][drop] = 0.0
            self._free_locked(drop)
        return len(drop)

    def extend_hold(self, refs: Iterable[SlotRef | None] | SlotRefs, hold_s: float) -> list[bool]:
        """Hold published slots for `hold_s` seconds from now, or longer where their hold already
        runs longer: what `publish(..., hold_s)` promises for the blocks a writer wrote, for the
        blocks it found already in the pool (`lookup`), whose own hold may be over. True where
        held; False for a missing ref (None) and a slot that no longer holds that generation,
        READY (evicted or reused since it was found)."""
        self._require_writable()
        refs = SlotRefs.of(refs)
        if not len(refs):
            return []
        with self._file_lock():
            c = self._cols
            return kernels.hold(c["state"], c["seq"], c["hold_until"], refs.slots, refs.seqs,
                                time.time() + float(hold_s)).tolist()

    def release_hold(self, refs: Iterable[SlotRef]) -> None:
        """End the publisher's hold early (the decode has what it needed)."""
        self._require_writable()
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

    def last_use(self) -> float:
        """When a slot was last reserved, published or pinned (the pool's creation if never)."""
        used = float(self._cols["last_use"].max()) if self.num_slots else 0.0
        return max(used, float(self._super["created"][0]))


def remove_pool(path: str) -> None:
    """Delete a pool file (not a device). Processes that still map it keep their mapping."""
    try:
        if not stat.S_ISCHR(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


_NONE_I64, _NONE_U64 = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64)


def _row_array(rows: Sequence[int]) -> np.ndarray:
    if isinstance(rows, range):
        return np.arange(rows.start, rows.stop, rows.step, dtype=np.int64)
    return np.asarray(rows, dtype=np.int64)


def copy_runs(src: np.ndarray, src_rows: Sequence[int], dst: np.ndarray,
              dst_rows: Sequence[int], sum_source: bool | None) -> np.ndarray:
    """Copy src rows to dst rows (uint8, equal widths up to dst's) and return each row's checksum,
    taken from the words as they are copied (one pass, shm_pool_kernels.copy_rows, whose stores
    bypass the caches): a writer's checksum of its source (`sum_source` True) or what a reader
    got (False). None (a pool without checksums): the same copy, its sums dropped (zeros); rows
    that are not whole 8-byte words are then copied by numpy."""
    src_at, dst_at = _row_array(src_rows), _row_array(dst_rows)
    width = (min(src.shape[1], dst.shape[1]) if sum_source is None
             else src.shape[1] if sum_source else dst.shape[1])
    sums = np.zeros(src_at.size, dtype=np.uint64)
    if not src_at.size:
        return sums
    if width % 8:
        if sum_source is not None:
            raise ValueError(f"checksummed rows are whole 8-byte words, not {width} bytes")
        for s, d in zip(src_at.tolist(), dst_at.tolist()):
            np.copyto(dst[d, :width], src[s, :width])
        return sums
    got = sums if sum_source is not None else np.empty_like(sums)
    kernels.copy_rows(src[:, :width].view(np.uint64), src_at, dst[:, :width].view(np.uint64),
                      dst_at, got)
    return sums
