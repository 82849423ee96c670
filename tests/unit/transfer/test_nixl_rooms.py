"""The prefill's lease table for pull transfers by room (transfer/nixl_rooms.py). The NIXL side
is tested with real agents over UCX in tests/sglang."""

import time

from pd_plugins.transfer.nixl_rooms import MAX_READ_S, LeaseTable


def test_a_lease_runs_out_unless_extended():
    table = LeaseTable(lease_s=0.2)
    table.lease(1)
    assert table.status(1) == "held"
    time.sleep(0.25)
    assert table.status(1) == "expired"


def test_heartbeats_and_read_starts_extend_and_done_ends():
    table = LeaseTable(lease_s=0.2)
    first = table.lease(7)
    time.sleep(0.05)
    table.feed([b"HB:7"])
    assert table.until(7) > first
    table.feed([b"START:7"])
    assert table.until(7) >= time.time() + MAX_READ_S - 1  # covers a whole read
    table.feed([b"DONE:7"])
    assert table.status(7) == "done"
    table.forget(7)
    assert table.status(7) == "expired" and table.until(7) == 0.0


def test_notifications_before_the_lease_count_and_junk_is_ignored():
    table = LeaseTable(lease_s=10)
    table.feed([b"DONE:3", b"HB:not-a-room", b"garbage", b"HB:", b"7:2"])
    table.lease(3)  # a fast decode's read finished before the prefill saw its own room
    assert table.status(3) == "done"
    assert table.status(4) == "expired"  # never leased
