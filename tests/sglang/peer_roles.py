"""Roles for tests/sglang/test_sglang_peers.py: what a peer (a request's bootstrap address, a
NIXL agent, a holder of the peer secret) can make our SGLang backends do. Real managers,
receivers and senders (SGLang's classes from `get_kv_class`), a real bootstrap registry and real
NIXL agents over UCX on loopback, in one process per role; each role prints JSON events.

Run through sglang_roles.py's `main` (`peer '{"role": NAME, ...}'`), forked by role_forkserver.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType
from sglang.srt.plugins import load_plugins

from pd_plugins.testing.processes import free_port
from tests.sglang.sglang_roles import POLL_S, EngineMemory, emit, failure_of, kv_class, server_args


def watchdog(what: str, limit_s: float) -> threading.Timer:
    """Emit a "stuck" event and end the process if `what` is not done within `limit_s` (a
    scheduler thread held for good prints nothing else); cancel() it when done."""
    def stuck() -> None:
        emit(event="stuck", what=what, limit_s=limit_s)
        os._exit(3)

    timer = threading.Timer(limit_s, stuck)
    timer.daemon = True
    timer.start()
    return timer


def _managers(backend: str, port: int, *modes: DisaggregationMode, num_pages: int = 64):
    """Real managers of `backend` for this process, one per mode, with their engine memory."""
    out = []
    for mode in modes:
        memory = EngineMemory(num_pages)
        role = "prefill" if mode == DisaggregationMode.PREFILL else "decode"
        out.append((kv_class(KVClassType.MANAGER, backend)(
            memory.kv_args(), mode, server_args(role, port, backend), False), memory))
    return out


def _conclude(obj, timeout_s: float) -> dict:
    """Poll `obj` as SGLang's scheduler does until it concludes: its outcome, and how long the
    scheduler's thread was held (the longest poll, and all of them)."""
    start, longest, blocked = time.monotonic(), 0.0, 0.0
    state = obj.state
    while time.monotonic() - start < timeout_s and state not in (KVPoll.Success, KVPoll.Failed):
        t = time.monotonic()
        state = obj.poll()
        took = time.monotonic() - t
        longest, blocked = max(longest, took), blocked + took
        time.sleep(POLL_S)
    return {"state": state, "failure": failure_of(obj) if state == KVPoll.Failed else "",
            "longest_poll_s": round(longest, 3), "blocked_s": round(blocked, 3),
            "took_s": round(time.monotonic() - start, 3)}


class Trickler:
    """What a request's bootstrap address may hold instead of a registry: a server that accepts,
    then sends an endless answer head a byte every `every_s` (each read returns in time)."""

    def __init__(self, port: int = 0, every_s: float = 0.2, close_every_other: bool = False
                 ) -> None:
        self.listener = socket.create_server(("127.0.0.1", port))
        self.port, self.every_s = self.listener.getsockname()[1], every_s
        self.close_every_other, self.connections = close_every_other, 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(sock,), daemon=True).start()

    def _one(self, sock: socket.socket) -> None:
        self.connections += 1
        with sock:
            if self.close_every_other and self.connections % 2 == 0:
                return  # closed at once: the call fails fast (not a stall)
            try:
                for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10**6:
                    sock.sendall(bytes([byte]))
                    time.sleep(self.every_s)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


def stalled_registry(spec: dict) -> None:
    """A decode whose request names an address that trickles its answers: in the bootstrap
    (both backends: the rank lookup), and (pd-nixl pull) after a good bootstrap, when the
    prefill's registry is replaced by a trickler on its port while the decode waits for the
    room. Each ends Failed, and SGLang's scheduler thread is held briefly."""
    load_plugins()
    trickler = Trickler()
    for backend in ("pd-shm", "pd-nixl"):
        [(mgr, _)] = _managers(backend, trickler.port, DisaggregationMode.DECODE)
        receiver = kv_class(KVClassType.RECEIVER, backend)(mgr, f"127.0.0.1:{trickler.port}", 5)
        timer = watchdog(f"{backend} bootstrap", 30)
        t = time.monotonic()
        receiver.init(0)
        init_s = time.monotonic() - t
        got = _conclude(receiver, 25)
        timer.cancel()
        emit(event="stalled", case=f"{backend} bootstrap", init_s=round(init_s, 3), **got)
        mgr.close()
    trickler.close()

    # stalls between calls that fail fast: only a signed answer ends a run of stalls
    trickler = Trickler(close_every_other=True)
    [(mgr, _)] = _managers("pd-shm", trickler.port, DisaggregationMode.DECODE)
    receiver = kv_class(KVClassType.RECEIVER, "pd-shm")(mgr, f"127.0.0.1:{trickler.port}", 5)
    timer = watchdog("pd-shm bootstrap, stalls between failures", 30)
    t = time.monotonic()
    receiver.init(0)
    init_s = time.monotonic() - t
    got = _conclude(receiver, 25)
    timer.cancel()
    emit(event="stalled", case="pd-shm bootstrap, stalls between failures",
         init_s=round(init_s, 3), **got)
    mgr.close()
    trickler.close()

    port = free_port()
    registry = kv_class(KVClassType.BOOTSTRAP_SERVER, "pd-nixl")(host="127.0.0.1", port=port)
    (prefill, memory), (decode, _) = _managers("pd-nixl", port, DisaggregationMode.PREFILL,
                                               DisaggregationMode.DECODE)
    receiver = kv_class(KVClassType.RECEIVER, "pd-nixl")(decode, f"127.0.0.1:{port}", 6)
    receiver.init(0)
    assert receiver.poll() == KVPoll.WaitingForInput, failure_of(receiver)
    import numpy as np
    receiver.send_metadata(np.array([1, 2], dtype=np.int32), 0, None)
    registry.close()  # the prefill's registry goes; a trickler takes its port
    trickler = Trickler(port)
    timer = watchdog("pd-nixl pull transfer", 30)
    got = _conclude(receiver, 25)
    timer.cancel()
    emit(event="stalled", case="pd-nixl pull transfer", init_s=0.0, **got)
    trickler.close()


def stalled_first_contact(spec: dict) -> None:
    """A request naming an address that trickles its answers, taken by SGLang's own first-contact
    path (DecodePreallocQueue.add, then _resolve_pending_reqs: try_ensure_parallel_info about
    once a `retry_s`, 15 times, then the receiver's abort): how long the scheduler's thread was
    held in all, and the room's reason. Then `addresses` more addresses that refuse connections:
    how many failure reasons the manager keeps."""
    load_plugins()
    from sglang.srt import runtime_context

    from tests.sglang.sglang_contract import decode_queue, receiver_view, request

    # SGLang's own test hook: a published dummy runtime config (add() reads it)
    runtime_context.get_context().override_server_args(device="cpu", host="127.0.0.1").install()
    trickler = Trickler()
    [(mgr, _)] = _managers("pd-shm", trickler.port, DisaggregationMode.DECODE)
    queue = decode_queue(mgr, "pd-shm")
    queue._ensure_retry_interval = spec["retry_s"]  # SGLang's 1 s, shortened
    queue.add(request("stalled", 5, trickler.port))
    timer = watchdog("first contact", 60)
    start, blocked, longest, rounds = time.monotonic(), 0.0, 0.0, 0
    while queue.pending_reqs and time.monotonic() - start < 50:
        t = time.monotonic()
        queue._resolve_pending_reqs()
        took = time.monotonic() - t
        blocked, longest, rounds = blocked + took, max(longest, took), rounds + 1
        time.sleep(0.02)
    timer.cancel()
    view = receiver_view(queue.queue[0])
    trickler.close()
    logging.getLogger("pd_plugins.sglang").setLevel(logging.ERROR)  # a warning per address
    for port in range(1, spec["addresses"] + 1):  # nothing listens there: refused at once
        mgr.try_ensure_parallel_info(f"127.0.0.1:{port}")
    emit(event="first_contact", pending=len(queue.pending_reqs), blocked_s=round(blocked, 3),
         longest_s=round(longest, 3), took_s=round(time.monotonic() - start, 3),
         failure=view["failure"], errors_kept=len(mgr.parallel_info_errors))
    mgr.close()


def unsettled_withdraw(spec: dict) -> None:
    """pd-nixl push decodes whose waiting timeout passes with their target published, so they
    withdraw it: withdrawn (200: nobody writes) fails the room at once; a target the registry no
    longer knows (404: evicted by churn) or a registry gone (no answer) may have been claimed, so
    the decode keeps its pages (Transferring) for MAX_WRITE_S (shortened to `max_write_s` here),
    then fails."""
    load_plugins()
    import numpy as np

    from pd_plugins.connectors.sglang import pd_nixl
    from pd_plugins.transfer import bootstrap_registry as br

    pd_nixl.MAX_WRITE_S = spec["max_write_s"]
    port = free_port()
    server = kv_class(KVClassType.BOOTSTRAP_SERVER, "pd-nixl")(host="127.0.0.1", port=port)
    targets = server.registry._server.tables["targets"]
    (prefill, _), (decode, _) = _managers("pd-nixl", port, DisaggregationMode.PREFILL,
                                          DisaggregationMode.DECODE)
    addr = f"127.0.0.1:{port}"
    for room, case in enumerate(("withdrawn", "evicted", "registry gone"), start=40):
        receiver = kv_class(KVClassType.RECEIVER, "pd-nixl")(decode, addr, room)
        receiver.init(0)
        assert receiver.poll() == KVPoll.WaitingForInput, failure_of(receiver)
        receiver.send_metadata(np.array([room], dtype=np.int32), 0, None)
        receiver.poll()
        assert receiver.target_published, failure_of(receiver)
        if case == "evicted":  # other decodes' targets churn it out of a small table
            targets.max_entries = len(targets)
            for other in range(1000, 1000 + len(targets)):
                br.put_target(addr, br.room_key(other, "0.0"), {})
        elif case == "registry gone":
            server.close()
        while time.monotonic() <= receiver.waiting_deadline:
            time.sleep(POLL_S)
        timer = watchdog(case, 40)
        got = _conclude(receiver, 30)
        timer.cancel()
        emit(event="withdrawn", case=case, **got)


def abort_while_quiet(spec: dict) -> None:
    """A pd-nixl push decode aborted while its registry is quiet after a stalled call (the
    stalled call may have been its target's publication, landed with the answer lost): the
    target's state in the registry after the abort."""
    load_plugins()
    import numpy as np

    port = free_port()
    server = kv_class(KVClassType.BOOTSTRAP_SERVER, "pd-nixl")(host="127.0.0.1", port=port)
    targets = server.registry._server.tables["targets"]
    (prefill, _), (decode, _) = _managers("pd-nixl", port, DisaggregationMode.PREFILL,
                                          DisaggregationMode.DECODE)
    receiver = kv_class(KVClassType.RECEIVER, "pd-nixl")(decode, f"127.0.0.1:{port}", 50)
    receiver.init(0)
    assert receiver.poll() == KVPoll.WaitingForInput, failure_of(receiver)
    receiver.send_metadata(np.array([3], dtype=np.int32), 0, None)
    receiver.poll()
    assert receiver.target_published, failure_of(receiver)
    receiver.registry_quiet_until = time.monotonic() + 60  # as after a stalled call
    receiver.abort()
    target = targets.get(receiver._target_key)
    emit(event="aborted", state=receiver.state, target=target and target.state)
    server.close()


def failed_republish(spec: dict) -> None:
    """A pd-nixl pull prefill whose republication (a decode's heartbeat extended the lease) fails,
    as a call to a stalled registry does: the room fails, so SGLang frees its pages; its lease
    must go and its record become a tombstone, or a decode could still READ those pages."""
    load_plugins()
    import numpy as np

    from pd_plugins.transfer import bootstrap_registry as br

    port, room = free_port(), 77
    server = kv_class(KVClassType.BOOTSTRAP_SERVER, "pd-nixl")(host="127.0.0.1", port=port)
    (prefill, memory), (decode, _) = _managers("pd-nixl", port, DisaggregationMode.PREFILL,
                                               DisaggregationMode.DECODE)
    put_room, publications = br.put_room, []

    def stalled_republication(addr, key, record, timeout_s=5.0):
        if "lease_until" in record:
            publications.append(record["lease_until"])
            if len(publications) == 2:  # the first republication
                raise br.RegistryStalled(f"bootstrap registry {addr} did not answer PUT (test)")
        return put_room(addr, key, record, timeout_s)

    br.put_room = stalled_republication
    memory.fill(room, [3, 4], 1)
    sender = kv_class(KVClassType.SENDER, "pd-nixl")(prefill, f"127.0.0.1:{port}", room)
    sender.init(2, 1)
    sender.send(np.array([3, 4], dtype=np.int32))
    receiver = kv_class(KVClassType.RECEIVER, "pd-nixl")(decode, f"127.0.0.1:{port}", room)
    receiver.init(0)
    assert receiver.poll() == KVPoll.WaitingForInput, failure_of(receiver)
    receiver.send_metadata(np.array([10, 11], dtype=np.int32), 2, None)
    timer = watchdog("failed republication", 60)
    deadline = time.monotonic() + 30
    while sender.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
        receiver.poll()  # a lease of 2 s: the decode heartbeats for more
        time.sleep(POLL_S)
    emit(event="sender", state=sender.poll(), failure=failure_of(sender),
         publications=len(publications), lease_until=prefill.leases.until(room),
         record=br.get_room(f"127.0.0.1:{port}", br.room_key(room, prefill.rank_key)))
    got = _conclude(receiver, 20)
    timer.cancel()
    emit(event="receiver", **got)
    server.close()


def _attacker(victim, name: str = "attacker"):
    """Another NIXL agent (UCX on loopback) that reached `victim`'s agent: (agent, peer name)."""
    import numpy as np

    from pd_plugins.transfer.nixl_rooms import NixlRoomAgent

    buf = np.zeros(4096, dtype=np.uint8)
    agent = NixlRoomAgent(f"{name}-{time.time_ns()}", [(buf.ctypes.data, buf.nbytes)])
    agent._buf = buf  # registered memory: kept alive with the agent
    return agent, agent.add_peer(victim.agent.metadata(), victim.agent.name)


def _poll_for(obj, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    state = obj.poll()
    while time.monotonic() < deadline and state not in (KVPoll.Success, KVPoll.Failed):
        time.sleep(POLL_S)
        state = obj.poll()
    return state


def push_notes(spec: dict) -> None:
    """pd-nixl push: WRITE notifications from a NIXL agent that is not the room's prefill (a
    3-field note without digests, an 8 MiB one) are ignored; the real WRITE then lands verified.
    A note from the prefill's own agent without digests, when its record says host KV, fails
    the room."""
    load_plugins()
    import numpy as np

    from pd_plugins.transfer.nixl_rooms import push_note

    port = free_port()
    server = kv_class(KVClassType.BOOTSTRAP_SERVER, "pd-nixl")(host="127.0.0.1", port=port)
    (prefill, pmem), (decode, dmem) = _managers("pd-nixl", port, DisaggregationMode.PREFILL,
                                                DisaggregationMode.DECODE)
    addr, aux_width = f"127.0.0.1:{port}", sum(buf.shape[1] for buf in dmem.aux)
    attacker, to_decode = _attacker(decode)
    timer = watchdog("push notes", 90)

    def receiver_for(room: int, dest: list[int], aux_index: int):
        receiver = kv_class(KVClassType.RECEIVER, "pd-nixl")(decode, addr, room)
        receiver.init(0)
        assert receiver.poll() == KVPoll.WaitingForInput, failure_of(receiver)
        receiver.send_metadata(np.array(dest, dtype=np.int32), aux_index, None)
        receiver.poll()
        assert receiver.target_published, failure_of(receiver)
        return receiver

    room, pages, dest = 4242, [3, 4], [20, 21]
    pmem.fill(room, pages, 1)
    sender = kv_class(KVClassType.SENDER, "pd-nixl")(prefill, addr, room)
    sender.init(len(pages), 1)
    sender.send(np.array(pages, dtype=np.int32))
    receiver = receiver_for(room, dest, 2)
    aux_before = dmem.digest(dest, 2)["aux"]
    attacker.notify(to_decode, push_note(room, time.time(), b"\x07" * aux_width, None))
    attacker.notify(to_decode, push_note(room, time.time(), b"\x07" * (8 << 20), None))
    deadline = time.monotonic() + 10  # until both came (8 MiB takes UCX a while), or a verdict
    spoofed = receiver.poll()
    while (time.monotonic() < deadline and spoofed not in (KVPoll.Success, KVPoll.Failed)
           and (getattr(decode, "notes_refused", 0) or 0) < 2):
        time.sleep(POLL_S)
        spoofed = receiver.poll()
    spoofed = _poll_for(receiver, 0.2)
    emit(event="spoofed", state=spoofed, failure=failure_of(receiver),
         aux_unchanged=dmem.digest(dest, 2)["aux"] == aux_before,
         refused=getattr(decode, "notes_refused", None))
    while sender.poll() == KVPoll.Transferring:  # the prefill claims the target and WRITEs
        receiver.poll()
        time.sleep(POLL_S)
    state = _poll_for(receiver, 10)
    emit(event="written", state=state, failure=failure_of(receiver),
         kv_verdict=receiver.kv_verdict, sent=sender.poll(),
         same=dmem.digest(dest, 2) == pmem.digest(pages, 1))

    # the prefill's own agent, as a prefill that states no digests would
    room = 4243
    receiver = receiver_for(room, [30], 3)
    to_decode = prefill.agent.add_peer(decode.agent.metadata(), decode.agent.name)
    prefill.agent.notify(to_decode, push_note(room, time.time(), b"\x01" * aux_width, None))
    state = _poll_for(receiver, 10)
    emit(event="undigested", state=state, failure=failure_of(receiver),
         awaited=len(getattr(decode, "awaited", ())), arrivals=len(decode.arrivals))

    # the prefill's own agent, a note larger than one of this room can be (one page: 8 bytes
    # of digest): never parsed
    room, refused = 4244, getattr(decode, "notes_refused", None)
    receiver = receiver_for(room, [31], 4)
    prefill.agent.notify(to_decode, push_note(room, time.time(), b"\x01" * aux_width,
                                              "A" * (1 << 20)))
    state = _poll_for(receiver, 1.0)
    emit(event="oversized", state=state, failure=failure_of(receiver),
         refused=(getattr(decode, "notes_refused", 0) or 0) - (refused or 0))
    timer.cancel()
    server.close()


def pull_notes(spec: dict) -> None:
    """pd-nixl pull: HB and DONE of a room from a NIXL agent that is not its reader: the DONE
    does not end the room (the prefill had freed its pages, before any READ); the decode's own
    READ then ends it."""
    load_plugins()
    import numpy as np

    port = free_port()
    server = kv_class(KVClassType.BOOTSTRAP_SERVER, "pd-nixl")(host="127.0.0.1", port=port)
    (prefill, pmem), (decode, dmem) = _managers("pd-nixl", port, DisaggregationMode.PREFILL,
                                                DisaggregationMode.DECODE)
    addr = f"127.0.0.1:{port}"
    attacker, to_prefill = _attacker(prefill)
    timer = watchdog("pull notes", 90)
    room, pages, dest = 5151, [5, 6, 7], [40, 41, 42]
    pmem.fill(room, pages, 4)
    sender = kv_class(KVClassType.SENDER, "pd-nixl")(prefill, addr, room)
    sender.init(len(pages), 4)
    sender.send(np.array(pages, dtype=np.int32))
    leased = prefill.leases.until(room)
    time.sleep(0.05)
    for message in (b"HB:%d" % room, b"DONE:%d" % room, b"HB:%d" % room):
        attacker.notify(to_prefill, message)
    deadline = time.monotonic() + 10  # until the prefill has taken them (the HBs extend it)
    spoofed = sender.poll()
    while (time.monotonic() < deadline and spoofed not in (KVPoll.Success, KVPoll.Failed)
           and prefill.leases.until(room) <= leased):
        time.sleep(POLL_S)
        spoofed = sender.poll()
    spoofed = _poll_for(sender, 0.2)
    emit(event="spoofed", state=spoofed, failure=failure_of(sender))
    receiver = kv_class(KVClassType.RECEIVER, "pd-nixl")(decode, addr, room)
    receiver.init(0)
    assert receiver.poll() == KVPoll.WaitingForInput, failure_of(receiver)
    receiver.send_metadata(np.array(dest, dtype=np.int32), 5, None)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (receiver.poll(), sender.poll()) != (KVPoll.Success,) * 2:
        time.sleep(POLL_S)
    emit(event="read", received=receiver.poll(), sent=sender.poll(),
         failure=failure_of(receiver) or failure_of(sender), reader=decode.agent.name,
         same=dmem.digest(dest, 5) == pmem.digest(pages, 4))
    timer.cancel()
    server.close()


def shm_failed_rooms(spec: dict) -> None:
    """pd-shm prefill rooms that fail on a later chunk (the pool has no free slot left: another
    prefill's held pages) or are aborted after a first chunk: the pages they published are never
    read, so their hold ends at once instead of keeping pool slots for PD_SHM_HOLD_S."""
    load_plugins()
    import numpy as np

    from pd_plugins.transfer.shm_rooms import RoomWriter

    port = free_port()
    server = kv_class(KVClassType.BOOTSTRAP_SERVER, "pd-shm")(host="127.0.0.1", port=port)
    [(prefill, memory)] = _managers("pd-shm", port, DisaggregationMode.PREFILL)
    pool = prefill.pool
    filler, page = RoomWriter(pool, "another-prefill", hold_s=600), 0
    while pool.stats().free > 2:  # room for one 2-page chunk
        count = max(1, min(256, pool.stats().free - 2))
        filler.put_pages(1, page, np.zeros((count, pool.slot_bytes), dtype=np.uint8))
        page += count
    for room, case in ((61, "later chunk fails"), (62, "aborted")):
        memory.fill(room, [1, 2, 3, 4], 0)
        held = pool.stats().held
        sender = kv_class(KVClassType.SENDER, "pd-shm")(prefill, f"127.0.0.1:{port}", room)
        sender.init(4, 0)
        sender.send(np.array([1, 2], dtype=np.int32))
        first = (sender.poll(), pool.stats().held - held)
        if case == "aborted":
            sender.abort()
        else:
            sender.send(np.array([3, 4], dtype=np.int32))
        emit(event="shm_room", case=case, first_chunk=first, state=sender.poll(),
             failure=failure_of(sender), held_after=pool.stats().held - held)
    server.close()
    prefill.close()


ROLES = {"stalled_registry": stalled_registry, "stalled_first_contact": stalled_first_contact,
         "abort_while_quiet": abort_while_quiet,
         "unsettled_withdraw": unsettled_withdraw,
         "failed_republish": failed_republish, "push_notes": push_notes,
         "pull_notes": pull_notes, "shm_failed_rooms": shm_failed_rooms}


def main(argv: list[str]) -> None:
    """`argv`: one JSON spec whose "role" names the role."""
    import json

    spec = json.loads(argv[0])
    ROLES[spec["role"]](spec)
