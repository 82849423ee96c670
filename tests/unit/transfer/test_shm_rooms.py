import logging

import msgspec
import numpy as np
import pytest

from pd_plugins.transfer.kv_faults import ALLOWED_VAR, KvFaults
from pd_plugins.transfer.shm_pool import ShmKVPool, remove_pool, row_checksums
from pd_plugins.transfer.shm_rooms import (
    MANIFEST_PAGE,
    RoomKvMismatch,
    RoomManifest,
    RoomReader,
    RoomTransferError,
    RoomWriter,
    room_key,
)

PAGE = 1024


@pytest.fixture
def pool(tmp_path):
    path = str(tmp_path / "pool")
    pool = ShmKVPool(path, slot_bytes=PAGE, layout="rooms-test", size_bytes=64 * PAGE + 2**16)
    yield pool
    pool.close()
    remove_pool(path)


def pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8)


def publish_room(writer: RoomWriter, room: int, src: np.ndarray, aux: bytes = b"aux") -> None:
    """A prefill's room: its pages in two chunks, then the manifest with their sums."""
    sums = [writer.put_pages(room, 0, src[:2]), writer.put_pages(room, 2, src[2:])]
    writer.put_manifest(room, RoomManifest(num_pages=len(src), page_bytes=PAGE, aux=aux),
                        np.concatenate(sums))


def test_pages_then_manifest_round_trip(pool):
    writer, reader = RoomWriter(pool, "p0", hold_s=30), RoomReader(pool, "p0")
    assert pool.checksums
    src = pages(5, 1)
    sums = writer.put_pages(7, 0, src[:3])
    assert np.array_equal(sums, row_checksums(src[:3]))  # the pool's own sums, for the manifest
    assert reader.manifest(7) is None  # pages alone: not ready
    sums = np.concatenate([sums, writer.put_pages(7, 3, src[3:])])
    writer.put_manifest(7, RoomManifest(num_pages=5, page_bytes=PAGE, aux=b"first token"), sums)
    manifest = reader.manifest(7)
    assert manifest == RoomManifest(num_pages=5, page_bytes=PAGE, aux=b"first token",
                                    page_sums=row_checksums(src).astype("<u8").tobytes())
    out = np.zeros((3, PAGE), dtype=np.uint8)
    assert reader.get_pages(7, [2, 3, 4], out, manifest) == "verified"
    assert np.array_equal(out, src[2:])
    assert reader.checks.counts == {"verified": 1, "mismatched": 0, "unverified": 0}
    assert pool.stats().held == 6
    reader.release(7, 5)
    assert pool.stats().held == 0 and pool.stats().ready == 6


class OldManifest(msgspec.Struct, frozen=True):
    """The manifest before issue 28 (no page sums)."""
    num_pages: int
    page_bytes: int
    aux: bytes = b""


def test_an_old_manifest_is_read_and_its_room_used_unverified(pool, caplog):
    writer = RoomWriter(pool, "p0", 30)
    for room in (1, 2):
        writer.put_pages(room, 0, pages(2, room))
        payload = msgspec.msgpack.encode(OldManifest(num_pages=2, page_bytes=PAGE, aux=b"x"))
        row = np.zeros((1, PAGE), dtype=np.uint8)
        row[0, :8] = np.frombuffer(len(payload).to_bytes(8, "little"), dtype=np.uint8)
        row[0, 8:8 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        writer._publish([room_key("p0", room, MANIFEST_PAGE)], row)
    reader, out = RoomReader(pool, "p0", peer="prefill-a"), np.zeros((2, PAGE), dtype=np.uint8)
    with caplog.at_level(logging.DEBUG, logger="pd_plugins.transfer.page_digests"):
        for room in (1, 2):
            manifest = reader.manifest(room)
            assert manifest == RoomManifest(num_pages=2, page_bytes=PAGE, aux=b"x")
            assert reader.get_pages(room, [0, 1], out, manifest) == "unverified"
            assert np.array_equal(out, pages(2, room))
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "stated no page sums" in warned[0].getMessage()  # once a peer
    assert reader.checks.counts == {"verified": 0, "mismatched": 0, "unverified": 2}
    with pytest.raises(RoomTransferError, match="cannot be verified.*stated no page sums"):
        RoomReader(pool, "p0", verify="required").get_pages(1, [0, 1], out, manifest)
    assert RoomReader(pool, "p0", verify="off").get_pages(1, [0, 1], out, manifest) is None


def test_a_pool_without_checksums_is_unverified(tmp_path):
    path = str(tmp_path / "plain")
    with ShmKVPool(path, slot_bytes=PAGE, layout="rooms-test", size_bytes=64 * PAGE + 2**16,
                   checksums=False) as plain:
        writer, reader = RoomWriter(plain, "p0", 30), RoomReader(plain, "p0")
        publish_room(writer, 3, pages(3, 3))
        manifest = reader.manifest(3)
        assert manifest.page_sums == b""  # nothing to state
        out = np.zeros((3, PAGE), dtype=np.uint8)
        assert reader.get_pages(3, [0, 1, 2], out, manifest) == "unverified"
        with pytest.raises(RoomTransferError, match="this pool has no checksums"):
            RoomReader(plain, "p0", verify="required").get_pages(3, [0], out[:1], manifest)
    remove_pool(path)


def test_sums_of_a_room_too_big_for_the_manifest_go_into_slots_of_their_own(tmp_path):
    path = str(tmp_path / "big")
    with ShmKVPool(path, slot_bytes=PAGE, layout="rooms-test",
                   size_bytes=200 * PAGE + 2**16) as pool:
        writer, reader = RoomWriter(pool, "p0", 30), RoomReader(pool, "p0")
        per_slot = PAGE // 8
        src = pages(per_slot + 3, 5)  # one manifest slot cannot hold these sums: two slots do
        publish_room(writer, 5, src)
        assert pool.stats().ready == len(src) + 1 + 2
        manifest = reader.manifest(5)
        assert manifest.sum_slots == 0 and manifest.page_sums == row_checksums(src).tobytes()
        out = np.zeros((4, PAGE), dtype=np.uint8)
        assert reader.get_pages(5, [0, 1, per_slot, per_slot + 2], out, manifest) == "verified"
        assert np.array_equal(out, src[[0, 1, per_slot, per_slot + 2]])
        reader.release(5, len(src))
        assert pool.stats().held == 0  # the sum slots too
    remove_pool(path)


def test_a_flipped_byte_is_a_mismatch(pool):
    writer, reader = RoomWriter(pool, "p0", 30), RoomReader(pool, "p0")
    publish_room(writer, 9, pages(3, 1))
    [ref] = pool.lookup([room_key("p0", 9, 1)])
    pool.data[ref.slot, 10] ^= 0xFF  # a stale or flipped cache line on non-coherent memory
    with pytest.raises(RoomKvMismatch, match=r"room 9: page 1 does not match what the prefill "
                                             r"published \(its bytes changed in the pool"):
        reader.get_pages(9, [0, 1, 2], np.zeros((3, PAGE), dtype=np.uint8), reader.manifest(9))
    assert reader.checks.counts["mismatched"] == 1


def test_a_slot_that_holds_another_page_consistently_is_a_mismatch(pool):
    """A slot whose bytes match its header, but not what the manifest states (another publisher's
    page under this key): only the manifest's sums can tell."""
    writer, reader = RoomWriter(pool, "p0", 30), RoomReader(pool, "p0")
    publish_room(writer, 4, pages(3, 4))
    [pinned] = pool.pin([room_key("p0", 4, 2)])
    pool.reuse_pinned(pinned, pages(1, 99)[0])  # new generation, bytes and header agree
    pool.unpin([pinned])
    out = np.zeros((3, PAGE), dtype=np.uint8)
    with pytest.raises(RoomKvMismatch, match=r"page 2 .* \(the pool holds other bytes than the "
                                             r"manifest states"):
        reader.get_pages(4, [0, 1, 2], out, reader.manifest(4))
    # with verification off the same room passes the pool's own checks: the manifest caught it
    assert RoomReader(pool, "p0", verify="off").get_pages(4, [0, 1, 2], out) is None


def test_every_injected_flip_and_reuse_is_caught(pool):
    allowed = {ALLOWED_VAR: "1"}
    writer = RoomWriter(pool, "p0", 0, KvFaults.from_spec("flip_slot:match=room:71", "t", allowed))
    reader = RoomReader(pool, "p0", faults=KvFaults.from_spec("reuse:match=room:72", "t", allowed))
    rooms = [71000 + i for i in range(50)] + [72000 + i for i in range(50)] + list(range(10))
    caught = {"bytes changed": 0, "reused": 0}
    out = np.zeros((3, PAGE), dtype=np.uint8)
    for room in rooms:
        src = pages(3, room)
        publish_room(writer, room, src)
        manifest = reader.manifest(room)
        try:
            verdict = reader.get_pages(room, [0, 1, 2], out, manifest)
        except RoomKvMismatch as exc:
            assert f"room {room}: page" in str(exc) and room >= 71000
            caught["bytes changed" if "bytes changed" in str(exc) else "reused"] += 1
            continue
        assert room < 71000 and verdict == "verified" and np.array_equal(out, src)
        reader.release(room, 3)
    assert writer.faults.injected["flip_slot"] == reader.faults.injected["reuse"] == 50
    assert caught == {"bytes changed": 50, "reused": 50}
    assert reader.checks.counts == {"verified": 10, "mismatched": 100, "unverified": 0}


def test_scopes_and_rooms_do_not_mix(pool):
    RoomWriter(pool, "p0", 30).put_pages(1, 0, pages(1, 1))
    RoomWriter(pool, "p1", 30).put_pages(1, 0, pages(1, 2))
    out = np.zeros((1, PAGE), dtype=np.uint8)
    RoomReader(pool, "p1").get_pages(1, [0], out)
    assert np.array_equal(out, pages(1, 2))
    with pytest.raises(RoomTransferError, match="no longer in the pool"):
        RoomReader(pool, "p0").get_pages(2, [0], out)
    assert len({room_key("p0", 1, 0), room_key("p1", 1, 0), room_key("p0", 2, 0)}) == 3


def test_a_room_is_published_once(pool):
    writer = RoomWriter(pool, "p0", 30)
    writer.put_pages(4, 0, pages(2, 1))
    with pytest.raises(RoomTransferError, match="already published"):
        writer.put_pages(4, 0, pages(2, 3))


def test_a_full_pool_is_a_clear_error(pool):
    writer = RoomWriter(pool, "p0", hold_s=60)  # held: nothing can be evicted
    with pytest.raises(RoomTransferError, match="no free slot"):
        for room in range(pool.num_slots + 1):
            writer.put_pages(room, 0, pages(1, room))


def test_a_manifest_too_big_for_a_slot(pool):
    with pytest.raises(RoomTransferError, match="does not fit"):
        RoomWriter(pool, "p0", 30).put_manifest(
            1, RoomManifest(num_pages=1, page_bytes=PAGE, aux=bytes(PAGE)))


def _fill_until_free(pool: ShmKVPool, free: int) -> None:
    """Another prefill's held pages take every slot but `free`."""
    filler = RoomWriter(pool, "other-prefill", hold_s=60)
    page = 0
    while pool.stats().free > free:
        filler.put_pages(1, page, np.zeros((1, pool.slot_bytes), dtype=np.uint8))
        page += 1


def test_a_failed_room_s_published_pages_and_sum_slots_are_released(tmp_path):
    """A room whose manifest cannot be published (no free slot) after its pages and its spilled
    page sums were: the sum slots' hold ends at once (they serve a manifest that never comes),
    and `release` ends the pages' (the prefill's sender does on failure and abort), so they do
    not hold pool slots for hold_s when no decode will read them."""
    path = str(tmp_path / "pool")
    pool = ShmKVPool(path, slot_bytes=64, layout="rooms-release", size_bytes=2**16)
    try:
        writer = RoomWriter(pool, "p0", hold_s=60)
        _fill_until_free(pool, 12)  # 10 pages and 2 sum slots fit; the manifest does not
        held = pool.stats().held
        src = np.random.default_rng(3).integers(0, 256, (10, 64), dtype=np.uint8)
        sums = writer.put_pages(9, 0, src)
        with pytest.raises(RoomTransferError, match="no free slot"):
            writer.put_manifest(9, RoomManifest(num_pages=10, page_bytes=64), sums)
        assert pool.stats().held == held + 10  # the sum slots' hold ended
        writer.release(9, 10)
        assert pool.stats().held == held
        assert RoomReader(pool, "p0").manifest(9) is None
    finally:
        pool.close()
        remove_pool(path)
