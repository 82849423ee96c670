"""The prefill's lease table for pull transfers by room (transfer/nixl_rooms.py). The NIXL side
is tested with real agents over UCX in tests/sglang."""

import time

from pd_plugins.transfer.nixl_rooms import MAX_EARLY_PER_ROOM, MAX_READ_S, LeaseTable


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
    table.feed([("decode", b"HB:7")])
    assert table.until(7) > first
    table.feed([("decode", b"START:7")])
    assert table.until(7) >= time.time() + MAX_READ_S - 1  # covers a whole read
    table.feed([("decode", b"DONE:7")])
    assert table.status(7) == "done"
    table.forget(7)
    assert table.status(7) == "expired" and table.until(7) == 0.0


def test_notifications_before_the_lease_count_and_junk_is_ignored():
    table = LeaseTable(lease_s=10)
    table.feed([("d", m) for m in (b"START:3", b"DONE:3", b"HB:not-a-room", b"garbage", b"HB:",
                                   b"7:2")])
    table.lease(3)  # a fast decode's read finished before the prefill saw its own room
    assert table.status(3) == "done"
    assert table.status(4) == "expired"  # never leased


def test_notifications_for_rooms_never_leased_are_bounded():
    """A peer naming rooms that never come (or repeating one) cannot grow the table: at most
    max_early rooms are remembered, the newest, each with at most one entry per kind."""
    table = LeaseTable(lease_s=10, max_early=100)
    table.feed([("d", b"%s:%d" % (kind, room)) for room in range(10_000)
                for kind in (b"HB", b"START", b"DONE")])
    table.feed([("d", m) for m in
                [b"HB:9999"] * 10_000 + [b"NOPE:5", b"HB:-1", b"HB:%d" % 2**64]])
    table.feed([(f"agent-{i}", b"DONE:9999") for i in range(1000)])  # many agents: a few kept
    assert len(table._early) == 100
    assert table._early[9999][:3] == [(b"HB", "d"), (b"START", "d"), (b"DONE", "d")]
    assert len(table._early[9999]) == MAX_EARLY_PER_ROOM
    assert 0 not in table._early and -1 not in table._early and 5 not in table._early
    table.lease(9999)  # still counted for a room that does come
    assert table.status(9999) == "done" and 9999 not in table._early


def test_only_the_agent_whose_start_came_first_ends_the_room():
    """Any NIXL peer can notify the prefill. A DONE ends a room only from the agent that sent
    its first START (the decode that reads it): another peer's DONE, with or without a START of
    its own after the decode's, does not free the pages during the decode's READ."""
    table = LeaseTable(lease_s=10)
    table.lease(5)
    table.feed([("mallory", b"DONE:5")])  # before any START: nobody's DONE counts yet
    assert table.status(5) == "held" and table.reader(5) is None
    table.feed([("decode", b"START:5"), ("mallory", b"START:5"), ("mallory", b"DONE:5")])
    assert table.reader(5) == "decode" and table.status(5) == "held"
    table.feed([("decode", b"DONE:5")])
    assert table.status(5) == "done"
    # the reader's DONE before its START (their order is not promised), also before the lease
    table.feed([("decode", b"DONE:6"), ("mallory", b"START:6")])
    table.lease(6)
    assert table.reader(6) == "mallory" and table.status(6) == "held"
    table.lease(7)
    table.feed([("decode", b"DONE:7"), ("decode", b"START:7")])
    assert table.status(7) == "done"


def test_heartbeats_from_anyone_extend_a_lease_only_so_far():
    """HB (and START) extend a lease whoever sends them, but never past lease_s +
    max_extension_s after it was leased (START: MAX_READ_S more, to cover a read started by
    then): a peer that knows a room number cannot hold its pages for good."""
    table = LeaseTable(lease_s=0.2, max_extension_s=0.3)
    leased = time.time()
    table.lease(9)
    for _ in range(8):
        table.feed([("mallory", b"HB:9")])
        time.sleep(0.1)
    assert table.until(9) <= leased + 0.5 + 0.05
    assert table.status(9) == "expired"
    table.feed([("mallory", b"START:9")] * 100)
    assert table.until(9) <= leased + 0.5 + MAX_READ_S + 0.05


def test_notifications_name_their_sender(monkeypatch):
    """Real NIXL agents (UCX): each notification comes with the name of the agent that sent it."""
    import numpy as np

    from pd_plugins.transfer.nixl_rooms import NixlRoomAgent

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    buffers = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]
    a, b, c = (NixlRoomAgent(f"test-{name}-{time.time_ns()}", [(buf.ctypes.data, buf.nbytes)])
               for name, buf in zip("abc", buffers))
    try:
        b.notify(b.add_peer(a.metadata(), a.name), b"HB:1")
        c.notify(c.add_peer(a.metadata(), a.name), b"DONE:1")
        got: list = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += a.notifications()
            time.sleep(0.01)
        assert sorted(got) == sorted([(b.name, b"HB:1"), (c.name, b"DONE:1")])
    finally:
        for agent in (a, b, c):
            agent.close()


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
