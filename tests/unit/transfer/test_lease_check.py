"""Lease checks over real ZMQ on loopback: the verdict a reader gets is the one the prefill recorded."""

import time

import pytest

from pd_plugins.transfer import lease_check
from pd_plugins.transfer.lease_check import LateReadGuard, LeaseCheckServer, VerdictTable


@pytest.fixture
def server():
    srv = LeaseCheckServer("127.0.0.1")
    yield srv
    srv.close()


def poll_until_settled(guard: LateReadGuard, timeout_s: float = 5.0):
    on_time, late, timed_out = set(), set(), set()
    deadline = time.monotonic() + timeout_s
    while guard.held() and time.monotonic() < deadline:
        result = guard.poll(wait_s=0.05)
        on_time |= result.on_time
        late |= result.late
        timed_out |= result.timed_out
    return on_time, late, timed_out


def test_verdict_table_is_bounded_and_late_sticks():
    table = VerdictTable(max_entries=3)
    table.record("r1", "d0", True)
    assert table.lookup("r1", "d0") == "ok"
    table.record("r1", "d0", False)
    table.record("r1", "d0", True)  # a second, on-time notification cannot clear a late one
    assert table.lookup("r1", "d0") == "late"
    assert table.lookup("r1", "d1") == "pending"  # verdicts are per reader
    for i in range(5):
        table.record(f"x{i}", "d0", True)
    assert len(table) == 3 and table.lookup("r1", "d0") == "pending"


def test_reader_gets_each_recorded_verdict(server):
    server.table.record("p-ok", "decode-agent", True)
    server.table.record("p-late", "decode-agent", False)
    server.table.record("p-other-reader", "someone-else", True)
    guard = LateReadGuard(reader="decode-agent", check_timeout_s=0.5)
    endpoint = ("127.0.0.1", server.port)
    guard.hold("d-ok", endpoint, "p-ok")
    guard.hold("d-late", endpoint, "p-late")
    guard.hold("d-other", endpoint, "p-other-reader")  # not this reader's verdict: never ok
    on_time, late, timed_out = poll_until_settled(guard)
    assert (on_time, late, timed_out) == ({"d-ok"}, {"d-late"}, {"d-other"})
    guard.close()


def test_pending_verdict_is_asked_again_until_it_arrives(server):
    guard = LateReadGuard(reader="decode-agent", check_timeout_s=5.0)
    guard.hold("d1", ("127.0.0.1", server.port), "p1")
    for _ in range(5):
        assert guard.poll(wait_s=0.02).on_time == set()
    server.table.record("p1", "decode-agent", True)  # the notification is processed now
    on_time, late, timed_out = poll_until_settled(guard)
    assert on_time == {"d1"} and not late and not timed_out
    guard.close()


def test_unreachable_server_fails_closed():
    guard = LateReadGuard(reader="decode-agent", check_timeout_s=0.3)
    from pd_plugins.testing.processes import free_port
    guard.hold("d1", ("127.0.0.1", free_port()), "p1")  # nobody listens there
    on_time, late, timed_out = poll_until_settled(guard)
    assert timed_out == {"d1"} and not on_time
    guard.close()


def test_server_ignores_malformed_queries(server):
    import zmq
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    sock.send(b"\x93garbage")
    sock.send_multipart([b"a", b"b"])
    server.table.record("p1", "r", True)
    guard = LateReadGuard(reader="r", check_timeout_s=2.0)
    guard.hold("d1", ("127.0.0.1", server.port), "p1")
    assert poll_until_settled(guard)[0] == {"d1"}  # still serving after the garbage
    sock.close()
    guard.close()


def test_released_request_without_verdict_is_late():
    table = VerdictTable()
    table.record("r1", "d0", True)
    table.release("r1")
    assert table.lookup("r1", "d0") == "ok"    # confirmed before the release
    assert table.lookup("r1", "d1") == "late"  # d1's notification had not come by then
    assert table.lookup("r2", "d0") == "pending"


def test_a_read_from_several_prefill_ranks_is_ok_only_when_every_rank_said_so():
    """A TP 1 decode reads a TP 2 prefill's two head halves; each prefill worker sees its own
    notification, possibly in different steps."""
    table = VerdictTable()
    table.record("r1", "d0", True, rank=0)
    assert table.lookup("r1", "d0", ranks=2) == "pending"  # rank 1's notification not yet seen
    assert table.lookup("r1", "d0", ranks=1) == "ok"
    table.record("r1", "d0", True, rank=1)
    assert table.lookup("r1", "d0", ranks=2) == "ok"
    table.record("r2", "d0", True, rank=0)
    table.record("r2", "d0", False, rank=1)  # rank 1's half was read after its lease ran out
    assert table.lookup("r2", "d0", ranks=2) == "late"
    table.record("r3", "d0", True, rank=1)
    table.release("r3")  # released without rank 0's verdict: that read came late
    assert table.lookup("r3", "d0", ranks=2) == "late"


def test_reader_asks_for_as_many_ranks_as_it_read(server):
    server.table.record("p1", "decode-agent", True, rank=0)
    guard = LateReadGuard(reader="decode-agent", check_timeout_s=5.0)
    guard.hold("d1", ("127.0.0.1", server.port), "p1", ranks=2)
    for _ in range(5):
        assert guard.poll(wait_s=0.02).on_time == set()  # still waiting for rank 1
    server.table.record("p1", "decode-agent", True, rank=1)
    on_time, late, timed_out = poll_until_settled(guard)
    assert on_time == {"d1"} and not late and not timed_out
    guard.hold("d2", ("127.0.0.1", server.port), "p1", ranks=lease_check.MAX_RANKS + 1)
    assert poll_until_settled(guard)[1] == {"d2"}  # an absurd rank count is never ok
    guard.close()


def test_what_a_peer_can_make_the_server_hold_is_bounded(server):
    """A query bigger than MAX_MESSAGE_BYTES costs its sender the connection, not the server
    memory; the server's queues are capped; other readers are still answered."""
    import zmq

    from pd_plugins.transfer import lease_check

    sock = server._socket
    assert sock.getsockopt(zmq.MAXMSGSIZE) == lease_check.MAX_MESSAGE_BYTES
    assert sock.getsockopt(zmq.RCVHWM) == sock.getsockopt(zmq.SNDHWM) == lease_check.HWM
    assert sock.getsockopt(zmq.HANDSHAKE_IVL) > 0 and sock.getsockopt(zmq.HEARTBEAT_IVL) > 0
    flood = zmq.Context.instance().socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(f"tcp://127.0.0.1:{server.port}")
    flood.send(b"\x00" * (10 * lease_check.MAX_MESSAGE_BYTES))
    flood.connect(f"tcp://127.0.0.1:{server.port}")  # a second connection: the first is dropped
    for _ in range(10_000):  # queries whose replies are never read
        try:
            flood.send(b"\x93\x01\xa2p1\xa1r", zmq.NOBLOCK)
        except zmq.Again:  # its own queue is full
            break
    server.table.record("p1", "r", True)
    guard = LateReadGuard(reader="r", check_timeout_s=5.0)
    guard.hold("d1", ("127.0.0.1", server.port), "p1")
    assert poll_until_settled(guard)[0] == {"d1"}
    flood.close()
    guard.close()


def test_a_request_id_too_long_to_ask_about_fails_closed_at_once():
    from pd_plugins.transfer import lease_check

    guard = LateReadGuard(reader="r", check_timeout_s=60)
    guard.hold("d1", ("127.0.0.1", 1), "x" * lease_check.MAX_MESSAGE_BYTES)
    assert guard.poll(wait_s=0).timed_out == {"d1"} and not guard._sockets
    guard.close()


def test_the_reader_keeps_sockets_to_a_bounded_number_of_prefills(server, monkeypatch):
    """Endpoints come from transfer parameters: however many there are, the reader holds at most
    MAX_ENDPOINTS sockets, and a read whose socket was closed is asked again."""
    from pd_plugins.testing.processes import free_port
    from pd_plugins.transfer import lease_check

    monkeypatch.setattr(lease_check, "MAX_ENDPOINTS", 3)
    server.table.record("p-real", "r", True)
    guard = LateReadGuard(reader="r", check_timeout_s=1.5)
    guard.hold("real", ("127.0.0.1", server.port), "p-real")
    for i in range(10):
        guard.hold(f"dead-{i}", ("127.0.0.1", free_port()), f"p{i}")
    on_time, late, timed_out = poll_until_settled(guard)
    assert len(guard._sockets) <= 3
    assert on_time == {"real"} and timed_out == {f"dead-{i}" for i in range(10)}
    guard.close()


def test_a_reply_from_another_endpoint_cannot_settle_a_read(server):
    """Endpoints come from transfer parameters: a lease-check server the decode was pointed at
    answers "ok" for every query id near its own (they are sequential); the read held at the real
    prefill stays held until the real prefill answers."""
    import msgspec
    import zmq

    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.ROUTER)
    rogue_port = rogue.bind_to_random_port("tcp://127.0.0.1")
    guard = LateReadGuard(reader="decode-agent", check_timeout_s=5.0)
    try:
        guard.hold("victim", ("127.0.0.1", server.port), "p-victim")  # no verdict there yet
        guard.hold("bait", ("127.0.0.1", rogue_port), "p-bait")
        guard.poll(wait_s=0.05)  # both queries go out
        assert rogue.poll(2000)
        identity, _ = rogue.recv_multipart()
        for query_id in range(10):
            rogue.send_multipart([identity, msgspec.msgpack.encode((query_id, "ok"))])
        on_time = set()
        for _ in range(20):
            on_time |= guard.poll(wait_s=0.02).on_time
        assert on_time == {"bait"}  # its own read only
        server.table.record("p-victim", "decode-agent", True)
        assert poll_until_settled(guard)[0] == {"victim"}  # the real prefill still decides
    finally:
        guard.close()
        rogue.close(0)
