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


def test_notifications_for_rooms_never_leased_are_bounded():
    """A peer naming rooms that never come (or repeating one) cannot grow the table: at most
    max_early rooms are remembered, the newest, each with at most one entry per kind."""
    table = LeaseTable(lease_s=10, max_early=100)
    table.feed([b"%s:%d" % (kind, room) for room in range(10_000)
                for kind in (b"HB", b"START", b"DONE")])
    table.feed([b"HB:9999"] * 10_000 + [b"NOPE:5", b"HB:-1", b"HB:%d" % 2**64])
    assert len(table._early) == 100
    assert table._early[9999] == {b"HB", b"START", b"DONE"}
    assert 0 not in table._early and -1 not in table._early and 5 not in table._early
    table.lease(9999)  # still counted for a room that does come
    assert table.status(9999) == "done" and 9999 not in table._early


def test_a_peer_must_be_the_agent_its_record_names(monkeypatch):
    """Real NIXL agents (UCX, host buffers): metadata that describes another agent than the
    record's `agent_name` is refused, and not kept as a peer."""
    import numpy as np
    import pytest

    from pd_plugins.transfer.nixl_rooms import NixlRoomAgent

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    buffers = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]
    a, b, c = (NixlRoomAgent(f"test-{name}-{time.time_ns()}", [(buf.ctypes.data, buf.nbytes)])
               for name, buf in zip("abc", buffers))
    try:
        with pytest.raises(ConnectionError, match="refused"):
            a.add_peer(b.metadata(), c.name)  # a record naming c, carrying b's metadata
        with pytest.raises(ConnectionError, match="refused"):
            a.add_peer(b.metadata(), None)    # a record naming no agent at all
        assert a.add_peer(b.metadata(), b.name) == b.name
        assert a.add_peer(b.metadata(), b.name) == b.name  # known: not added twice
        with pytest.raises(ConnectionError, match="refused"):
            a.add_peer(b.metadata(), c.name)
    finally:
        for agent in (a, b, c):
            agent.close()


def test_push_notes_carry_digests_and_the_older_form_has_none():
    import pytest

    from pd_plugins.transfer.nixl_rooms import PushNote, parse_push_note, push_note

    note = push_note(2**63 + 5, 1700000000.25, b"\x00:aux", "AAAAAAAAAAA=")
    assert parse_push_note(note) == PushNote(2**63 + 5, 1700000000.25, b"\x00:aux", "AAAAAAAAAAA=")
    older = push_note(7, 1.5, b"row", None)  # a prefill from before issue 28: 4 fields
    assert older.count(b":") == 3
    assert parse_push_note(older) == PushNote(7, 1.5, b"row", None)
    assert parse_push_note(b"HB:7") is None and parse_push_note(b"DONE:7") is None
    for junk in (b"PUSHED:7", b"PUSHED:x:1:cm93", b"PUSHED:7:1:not base64!", b"PUSHED:7:1:cm93:a:b"):
        with pytest.raises(ValueError, match="malformed WRITE notification"):
            parse_push_note(junk)
