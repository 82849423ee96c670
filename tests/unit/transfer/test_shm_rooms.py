import numpy as np
import pytest

from pd_plugins.transfer.shm_pool import ShmKVPool, remove_pool
from pd_plugins.transfer.shm_rooms import (
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


def test_pages_then_manifest_round_trip(pool):
    writer, reader = RoomWriter(pool, "p0", hold_s=30), RoomReader(pool, "p0")
    src = pages(5, 1)
    writer.put_pages(7, 0, src[:3])
    assert reader.manifest(7) is None  # pages alone: not ready
    writer.put_pages(7, 3, src[3:])
    writer.put_manifest(7, RoomManifest(num_pages=5, page_bytes=PAGE, aux=b"first token"))
    manifest = reader.manifest(7)
    assert manifest == RoomManifest(num_pages=5, page_bytes=PAGE, aux=b"first token")
    out = np.zeros((3, PAGE), dtype=np.uint8)
    assert reader.get_pages(7, [2, 3, 4], out) == 3 * PAGE
    assert np.array_equal(out, src[2:])
    assert pool.stats().held == 6
    reader.release(7, 5)
    assert pool.stats().held == 0 and pool.stats().ready == 6


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


def test_a_torn_page_is_refused(pool):
    writer, reader = RoomWriter(pool, "p0", 30), RoomReader(pool, "p0")
    writer.put_pages(9, 0, pages(1, 1))
    [ref] = pool.lookup([room_key("p0", 9, 0)])
    pool.data[ref.slot, 10] ^= 0xFF  # a stale or flipped cache line on non-coherent memory
    with pytest.raises(RoomTransferError, match="torn"):
        reader.get_pages(9, [0], np.zeros((1, PAGE), dtype=np.uint8))


def test_a_manifest_too_big_for_a_slot(pool):
    with pytest.raises(RoomTransferError, match="does not fit"):
        RoomWriter(pool, "p0", 30).put_manifest(
            1, RoomManifest(num_pages=1, page_bytes=PAGE, aux=bytes(PAGE)))
