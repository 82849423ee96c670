"""One PD transfer ("room") through the shared-memory KV pool, for engines that name transfers
by room rather than by block hash (SGLang's bootstrap rooms).

The prefill publishes the room's pages (one pool slot per KV page, all layers) as they are
computed, then a manifest (page count and the engine's small per-request metadata, such as the
first output token). The manifest goes last, so a decode that sees it can pin every page. The
decode copies only the pages it lacks (its own prefix cache may hold the first ones), then ends
the prefill's hold so the slots can be evicted.

Keys are SHA-256 of (scope, room, page): a scope per pool user (the prefill's rank) keeps two
prefill engines that draw the same room apart.

Verified hand-off (issue 28; docs/plans/kv-verification.md §4.6), in a pool with checksums: the
manifest states the producer's sum of every page (`page_sums`; those of a room too big for the
manifest's slot go into slots of their own, `sum_slots`). The pool header's checksum is bound to
a slot's generation, the manifest to the room: the reader checks the bytes it copied against the
header (`read_many`), the generation (`unpin`) and the header against the manifest, and uses no
page that fails (`RoomKvMismatch`). A pool without checksums, or a manifest without sums (an older
prefill), is `unverified`. Faults (transfer/kv_faults.py, rooms matched as `room:<number>`):
`flip_slot` (writer: a byte of one of the room's published pages) and `reuse` (reader: a pinned
page's slot reused between pin and copy).

Engine-agnostic: numpy, msgspec and transfer/ only.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import msgspec
import numpy as np

from pd_plugins.transfer.kv_faults import KvFaults, position
from pd_plugins.transfer.page_digests import PageChecks, fault_target
from pd_plugins.transfer.shm_pool import PinnedSlots, PoolError, ShmKVPool

MANIFEST_PAGE = -1
FIRST_SUMS_PAGE = -2  # sum slots are pages -2, -3, ...


class RoomManifest(msgspec.Struct, frozen=True):
    num_pages: int       # pages the prefill published, numbered from 0
    page_bytes: int      # bytes per page (one slot's payload)
    aux: bytes = b""     # the engine's per-request metadata, copied verbatim
    # the producer's pool checksum of each page, little-endian u64 (empty: it stated none)
    page_sums: bytes = b""
    sum_slots: int = 0   # slots that hold page_sums instead (a room too big for this slot)


class RoomTransferError(RuntimeError):
    """A room cannot complete: pool full, a page evicted or torn, a manifest that does not fit."""


class RoomKvMismatch(RoomTransferError):
    """A page is not what the prefill published: the room fails and its KV is never used."""


def room_key(scope: str, room: int, page: int) -> bytes:
    return hashlib.sha256(f"pd-room|{scope}|{int(room)}|{int(page)}".encode()).digest()


class RoomWriter:
    """Prefill side: publish a room's pages, then its manifest."""

    def __init__(self, pool: ShmKVPool, scope: str, hold_s: float,
                 faults: KvFaults | None = None) -> None:
        self.pool, self.scope, self.hold_s = pool, scope, hold_s
        self.faults = faults or KvFaults.none()

    def put_pages(self, room: int, first_page: int, rows: np.ndarray) -> np.ndarray:
        """Publish rows ([n, page_bytes] uint8) as pages first_page...; returns their pool
        checksums (uint64, zeros in a pool without checksums), for the manifest."""
        keys = [room_key(self.scope, room, first_page + i) for i in range(len(rows))]
        return self._publish(keys, rows)

    def put_manifest(self, room: int, manifest: RoomManifest,
                     page_sums: np.ndarray | None = None) -> None:
        """Publish the manifest, last: with `page_sums` (what put_pages returned, in page order)
        in a pool with checksums; they go into slots of their own if the manifest's is too small."""
        if page_sums is not None and self.pool.checksums:
            manifest = msgspec.structs.replace(
                manifest, page_sums=np.asarray(page_sums, dtype="<u8").tobytes())
            if _manifest_bytes(manifest) > self.pool.slot_bytes:
                per_slot, count = _sums_per_slot(self.pool), _sum_slots(self.pool, len(page_sums))
                flat = np.zeros(count * per_slot, dtype="<u8")
                flat[:len(page_sums)] = page_sums
                rows = np.zeros((count, self.pool.slot_bytes), dtype=np.uint8)  # whole slots
                rows[:, :per_slot * 8] = flat.view(np.uint8).reshape(count, per_slot * 8)
                self._publish([room_key(self.scope, room, FIRST_SUMS_PAGE - i)
                               for i in range(count)], rows)
                manifest = msgspec.structs.replace(manifest, page_sums=b"", sum_slots=count)
        try:
            self._flip_slot(room, manifest.num_pages)
            payload = msgspec.msgpack.encode(manifest)
            if len(payload) + 8 > self.pool.slot_bytes:
                raise RoomTransferError(f"room {room}: a {len(payload)}-byte manifest does not "
                                        f"fit a {self.pool.slot_bytes}-byte slot")
            row = np.zeros((1, self.pool.slot_bytes), dtype=np.uint8)  # length, then the payload
            row[0, :8] = np.frombuffer(len(payload).to_bytes(8, "little"), dtype=np.uint8)
            row[0, 8:8 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
            self._publish([room_key(self.scope, room, MANIFEST_PAGE)], row)
        except (RoomTransferError, PoolError):
            if manifest.sum_slots:  # published for a manifest that never comes
                self._release(room, [FIRST_SUMS_PAGE - i for i in range(manifest.sum_slots)])
            raise

    def release(self, room: int, num_pages: int) -> None:
        """End the hold of the room's pages 0..num_pages - 1, which this writer published, when
        the room fails or is aborted before its manifest: no decode will read them, so they need
        not keep pool slots for the hold (other writers may evict them at once)."""
        self._release(room, list(range(num_pages)))

    def _release(self, room: int, pages: list[int]) -> None:
        refs = self.pool.lookup([room_key(self.scope, room, p) for p in pages])
        self.pool.release_hold([ref for ref in refs if ref is not None])

    def _flip_slot(self, room: int, num_pages: int) -> None:
        """Fault injection (`flip_slot`): one byte of one of the room's published pages, its
        header (and checksum) untouched, as a stray write or a bad memory line would."""
        target = fault_target(room)
        rule = self.faults.take("flip_slot", target) if self.faults.enabled and num_pages else None
        if rule is None:
            return
        page = position(rule, target + ":page", num_pages)
        [ref] = self.pool.lookup([room_key(self.scope, room, page)])
        if ref is not None:
            self.pool.data[ref.slot, position(rule, target, self.pool.slot_bytes)] ^= 0xFF

    def _publish(self, keys: list[bytes], rows: np.ndarray) -> np.ndarray:
        refs = self.pool.reserve(keys)
        if any(ref is None for ref in refs):
            self.pool.abandon([ref for ref in refs if ref is not None])
            if any(self.pool.lookup([k for k, ref in zip(keys, refs) if ref is None])):
                raise RoomTransferError("this room was already published: a room carries one "
                                        "transfer (bootstrap rooms must not be reused)")
            raise RoomTransferError(
                f"no free slot in KV pool {self.pool.path} ({self.pool.num_slots} slots; "
                "every slot is held, pinned or being written): give the pool more memory or "
                "a shorter hold")
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        sums = self.pool.write_many(refs, rows)
        published = self.pool.publish(
            [(ref, int(s), rows.shape[1]) for ref, s in zip(refs, sums)], hold_s=self.hold_s)
        if not all(published):
            raise RoomTransferError("a write lease ran out before publishing (writer too slow)")
        return sums


def _manifest_bytes(manifest: RoomManifest) -> int:
    return len(msgspec.msgpack.encode(manifest)) + 8  # the length word, then the payload


def _sums_per_slot(pool: ShmKVPool) -> int:
    return pool.slot_bytes // 8


def _sum_slots(pool: ShmKVPool, num_pages: int) -> int:
    """Slots that hold `num_pages` page sums when they do not fit the manifest."""
    return -(-num_pages // _sums_per_slot(pool))


class RoomReader:
    """Decode side: wait for a room's manifest, copy the pages it needs (checked, when `verify` is
    not `off`, against what the prefill published: `checks` counts the verdicts), end the hold."""

    def __init__(self, pool: ShmKVPool, scope: str, verify: str = "on",
                 checks: PageChecks | None = None, faults: KvFaults | None = None,
                 peer: str = "the prefill") -> None:
        self.pool, self.scope, self.verify, self.peer = pool, scope, verify, peer
        self.checks = checks or PageChecks()
        self.faults = faults or KvFaults.none()

    def manifest(self, room: int) -> RoomManifest | None:
        """The room's manifest, or None while the prefill has not finished publishing. Its
        `page_sums` hold every page's sum however they were published (empty: none stated)."""
        [out] = self._read_slots(room, [MANIFEST_PAGE], "manifest", missing_ok=True) or [None]
        if out is None:
            return None
        length = int.from_bytes(out[:8].tobytes(), "little")
        manifest = msgspec.msgpack.Decoder(RoomManifest).decode(out[8:8 + length].tobytes())
        if manifest.sum_slots:
            if manifest.sum_slots != _sum_slots(self.pool, manifest.num_pages):
                raise RoomTransferError(f"room {room}: a manifest with {manifest.sum_slots} sum "
                                        f"slots for {manifest.num_pages} pages")
            rows = self._read_slots(room, [FIRST_SUMS_PAGE - i for i in range(manifest.sum_slots)],
                                    "page sums")
            width = _sums_per_slot(self.pool) * 8
            manifest = msgspec.structs.replace(
                manifest, sum_slots=0,
                page_sums=b"".join(r[:width].tobytes() for r in rows)[:manifest.num_pages * 8])
        if manifest.page_sums and len(manifest.page_sums) != manifest.num_pages * 8:
            raise RoomTransferError(f"room {room}: the manifest states {len(manifest.page_sums)} "
                                    f"bytes of page sums for {manifest.num_pages} pages")
        return manifest

    def _read_slots(self, room: int, pages: list[int], what: str,
                    missing_ok: bool = False) -> list[np.ndarray] | None:
        """Whole slots of the room's pages (its manifest, its sums), checked against their
        headers and generations; None for a missing slot if `missing_ok`."""
        pinned = self.pool.pin([room_key(self.scope, room, p) for p in pages])
        if any(p is None for p in pinned):
            self.pool.unpin([p for p in pinned if p is not None])
            if missing_ok:
                return None
            raise RoomTransferError(f"room {room}: its {what} are no longer in the pool")
        out = np.empty((len(pages), self.pool.slot_bytes), dtype=np.uint8)
        checks = self.pool.read_many(pinned, out)
        if not (all(self.pool.unpin(pinned)) and all(checks)):
            raise RoomTransferError(f"room {room}: torn {what}")
        return list(out)

    def get_pages(self, room: int, pages: Sequence[int], out: np.ndarray,
                  manifest: RoomManifest | None = None) -> str | None:
        """Copy pages into the rows of out ([len(pages), page_bytes] uint8), checked against the
        room's `manifest`. Returns the verdict (`verified`, `unverified`; None with verify off);
        raises RoomKvMismatch for a page that is not what the prefill published (replaced while
        read, its bytes changed in the pool, or not the page the manifest states)."""
        keys = [room_key(self.scope, room, p) for p in pages]
        stated, unverified_why = self._stated_sums(room, pages, manifest)
        pinned = self.pool.pin(keys)
        try:
            missing = [p for p, pin in zip(pages, pinned) if pin is None]
            if missing:
                raise RoomTransferError(f"room {room}: pages {missing[:8]} are no longer in the "
                                        "pool (evicted after the prefill's hold)")
            self._reuse(room, pinned)
            checks = self.pool.read_many(pinned, out)
        finally:
            kept = self.pool.unpin([p for p in pinned if p is not None])
        problems = (("its slot was reused while it was read", np.logical_not(kept)),
                    ("its bytes changed in the pool", np.logical_not(checks)),
                    ("the pool holds other bytes than the manifest states",
                     pinned.checksums != stated if stated is not None else np.zeros(0, bool)))
        for why, bad in problems:
            if bad.any():
                if self.verify != "off":
                    self.checks.count("mismatched")
                raise RoomKvMismatch(
                    f"room {room}: page {pages[int(np.flatnonzero(bad)[0])]} does not match "
                    f"what the prefill published ({why}; {int(bad.sum())} of {len(pages)} pages); "
                    "the KV is not used")
        if self.verify == "off":
            return None
        if unverified_why:
            self.checks.count("unverified")
            self.checks.warn_once(self.peer, f"room {room}: KV from {self.peer} used "
                                             f"unverified ({unverified_why})")
            return "unverified"
        self.checks.count("verified")
        return "verified"

    def _stated_sums(self, room: int, pages: Sequence[int], manifest: RoomManifest | None
                     ) -> tuple[np.ndarray | None, str]:
        """The prefill's sums of `pages`, or None and why there is nothing to check them
        against (`required` refuses that; verify off: no reason)."""
        if self.verify == "off":
            return None, ""
        why = ("this pool has no checksums" if not self.pool.checksums
               else "the prefill stated no page sums" if manifest is None or not manifest.page_sums
               else "")
        if not why:
            return np.frombuffer(manifest.page_sums, dtype="<u8")[np.asarray(pages, np.int64)], ""
        if self.verify == "required":
            raise RoomTransferError(f"room {room}: the KV cannot be verified ({why}) and "
                                    "PD_VERIFY_KV is `required`")
        return None, why

    def _reuse(self, room: int, pinned: PinnedSlots) -> None:
        """Fault injection (`reuse`): one pinned page's slot reused between pin and copy, as
        another writer would leave it (a new generation holding another page's bytes)."""
        target = fault_target(room)
        rule = self.faults.take("reuse", target) if self.faults.enabled else None
        if rule is None:
            return
        i = position(rule, target + ":page", len(pinned))
        other = self.pool.read(pinned[(i + 1) % len(pinned)]).copy()
        if len(pinned) == 1:
            other ^= 0xFF
        self.pool.reuse_pinned(pinned[i], other)

    def release(self, room: int, num_pages: int) -> None:
        """End the prefill's hold on the room's slots: the decode has what it needs."""
        sum_slots = _sum_slots(self.pool, num_pages)  # if it spilled them: absent ones are skipped
        keys = [room_key(self.scope, room, p) for p in (
            *range(num_pages), MANIFEST_PAGE,
            *(FIRST_SUMS_PAGE - i for i in range(sum_slots)))]
        self.pool.release_hold([ref for ref in self.pool.lookup(keys) if ref is not None])


__all__ = ["RoomKvMismatch", "RoomManifest", "RoomReader", "RoomTransferError", "RoomWriter",
           "room_key", "PoolError"]
