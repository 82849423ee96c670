"""One PD transfer ("room") through the shared-memory KV pool, for engines that name transfers
by room rather than by block hash (SGLang's bootstrap rooms).

The prefill publishes the room's pages (one pool slot per KV page, all layers) as they are
computed, then a manifest (page count and the engine's small per-request metadata, such as the
first output token). The manifest goes last, so a decode that sees it can pin every page. The
decode copies only the pages it lacks (its own prefix cache may hold the first ones), then ends
the prefill's hold so the slots can be evicted.

Keys are SHA-256 of (scope, room, page): a scope per pool user (the prefill's rank) keeps two
prefill engines that draw the same room apart. Engine-agnostic: numpy and msgspec.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import msgspec
import numpy as np

from pd_plugins.transfer.shm_pool import PoolError, ShmKVPool

MANIFEST_PAGE = -1


class RoomManifest(msgspec.Struct, frozen=True):
    num_pages: int       # pages the prefill published, numbered from 0
    page_bytes: int      # bytes per page (one slot's payload)
    aux: bytes = b""     # the engine's per-request metadata, copied verbatim


class RoomTransferError(RuntimeError):
    """A room cannot complete: pool full, a page evicted or torn, a manifest that does not fit."""


def room_key(scope: str, room: int, page: int) -> bytes:
    return hashlib.sha256(f"pd-room|{scope}|{int(room)}|{int(page)}".encode()).digest()


class RoomWriter:
    """Prefill side: publish a room's pages, then its manifest."""

    def __init__(self, pool: ShmKVPool, scope: str, hold_s: float) -> None:
        self.pool, self.scope, self.hold_s = pool, scope, hold_s

    def put_pages(self, room: int, first_page: int, rows: np.ndarray) -> int:
        """Publish rows ([n, page_bytes] uint8) as pages first_page...; returns the bytes written."""
        keys = [room_key(self.scope, room, first_page + i) for i in range(len(rows))]
        self._publish(keys, rows)
        return int(rows.nbytes)

    def put_manifest(self, room: int, manifest: RoomManifest) -> None:
        payload = msgspec.msgpack.encode(manifest)
        if len(payload) + 8 > self.pool.slot_bytes:
            raise RoomTransferError(f"room {room}: a {len(payload)}-byte manifest does not fit "
                                    f"a {self.pool.slot_bytes}-byte slot")
        row = np.zeros((1, self.pool.slot_bytes), dtype=np.uint8)  # length, then the payload
        row[0, :8] = np.frombuffer(len(payload).to_bytes(8, "little"), dtype=np.uint8)
        row[0, 8:8 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        self._publish([room_key(self.scope, room, MANIFEST_PAGE)], row)

    def _publish(self, keys: list[bytes], rows: np.ndarray) -> None:
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


class RoomReader:
    """Decode side: wait for a room's manifest, copy the pages it needs, end the hold."""

    def __init__(self, pool: ShmKVPool, scope: str) -> None:
        self.pool, self.scope = pool, scope

    def manifest(self, room: int) -> RoomManifest | None:
        """The room's manifest, or None while the prefill has not finished publishing."""
        key = room_key(self.scope, room, MANIFEST_PAGE)
        [pinned] = self.pool.pin([key])
        if pinned is None:
            return None
        out = np.empty((1, self.pool.slot_bytes), dtype=np.uint8)
        checks = self.pool.read_many([pinned], out)
        if not (self.pool.unpin([pinned])[0] and checks[0]):
            raise RoomTransferError(f"room {room}: torn manifest")
        length = int.from_bytes(out[0, :8].tobytes(), "little")
        return msgspec.msgpack.Decoder(RoomManifest).decode(out[0, 8:8 + length].tobytes())

    def get_pages(self, room: int, pages: Sequence[int], out: np.ndarray) -> int:
        """Copy pages into the rows of out ([len(pages), page_bytes] uint8); returns bytes read."""
        keys = [room_key(self.scope, room, p) for p in pages]
        pinned = self.pool.pin(keys)
        try:
            missing = [p for p, pin in zip(pages, pinned) if pin is None]
            if missing:
                raise RoomTransferError(f"room {room}: pages {missing[:8]} are no longer in the "
                                        "pool (evicted after the prefill's hold)")
            checks = self.pool.read_many(pinned, out)
        finally:
            kept = self.pool.unpin([p for p in pinned if p is not None])
        if not (all(kept) and all(checks)):
            raise RoomTransferError(f"room {room}: a page changed while it was read (torn)")
        return int(out.nbytes)

    def release(self, room: int, num_pages: int) -> None:
        """End the prefill's hold on the room's slots: the decode has what it needs."""
        keys = [room_key(self.scope, room, p) for p in (*range(num_pages), MANIFEST_PAGE)]
        self.pool.release_hold([ref for ref in self.pool.lookup(keys) if ref is not None])


__all__ = ["RoomManifest", "RoomReader", "RoomTransferError", "RoomWriter", "room_key",
           "PoolError"]
