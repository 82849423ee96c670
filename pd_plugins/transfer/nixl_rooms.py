"""Pull transfers by room over NIXL (UCX): the decode READs the prefill's pages, under a lease.

Engine-agnostic: a NIXL agent over an engine rank's KV buffers (host or CUDA memory), and the
prefill's lease table.

Protocol, per room:
1. The prefill publishes the room (its pages, the engine's metadata row, and `lease_until`) in
   its bootstrap registry (transfer/bootstrap_registry.py) and keeps the pages until the lease
   ends.
2. The decode, while it waits for that record, sends `HB:<room>` notifications to the prefill's
   agent (each extends the lease to now + lease_s). Once the record is there it starts the READ
   only if the lease has more than `START_MARGIN_S` left, and announces it with `START:<room>`
   (the prefill extends the lease to cover a read of up to `MAX_READ_S`).
3. The READ carries `DONE:<room>` as its notification, which NIXL delivers after the data: the
   prefill frees the pages when it arrives. A read that has not completed within
   `MAX_READ_S - START_MARGIN_S` is abandoned by the decode, so it never uses pages read after
   the prefill may have freed them.
Lease times are wall-clock: prefill and decode hosts need synchronised clocks (same host here).

Who may say what: any NIXL peer can send any agent a notification, and the prefill learns the
decode's agent only from its notifications. So a room is bound to the agent whose `START` came
first: only that agent's `DONE` ends it. `HB` and `START` from anyone extend the lease, but
never past `lease_s + max_extension_s` after the room was leased (`START`: plus MAX_READ_S, to
cover a read started before then): a peer that knows a room number can hold its pages that long
at most, and can end it early only by sending `START` before the decode does.
"""

from __future__ import annotations

import base64
import contextlib
import threading
import time
from collections import OrderedDict
from typing import NamedTuple, Sequence

START_MARGIN_S = 5.0
MAX_READ_S = 30.0
MAX_WRITE_S = 30.0  # push (connectors/sglang/pd_nixl.py): a WRITE's limit, as a READ's
MAX_EARLY = 10_000  # rooms with notifications that came before the room was leased
MAX_EARLY_PER_ROOM = 8  # (kind, agent) pairs kept per such room, and agents whose DONE came
MAX_EXTENSION_S = 600.0  # how far heartbeats may extend a lease past its first lease_s
MAX_AGENT_NAME = 256  # a notification's agent name longer than this is not one of ours
_KINDS = (b"HB", b"START", b"DONE")


def _nixl():
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent, nixl_agent_config


@contextlib.contextmanager
def _as_connection_error(peer: str):
    """NIXL's errors (its own exception types: a peer that disconnected, ...) as ConnectionError."""
    try:
        yield
    except ConnectionError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ConnectionError(f"NIXL peer {peer}: {type(exc).__name__}: {exc}") from exc


class Memory(NamedTuple):
    """Where registered buffers are: NIXL's memory type ("DRAM" host, "VRAM" GPU) and device id."""

    kind: str = "DRAM"
    device_id: int = 0

    @property
    def on_host(self) -> bool:
        return self.kind == "DRAM"


HOST = Memory()


class NixlRoomAgent:
    """A NIXL agent (UCX) over one engine rank's registered KV buffers, in host memory ("DRAM")
    or on a GPU ("VRAM", device id: UCX moves it without a host copy where it was built with
    CUDA)."""

    def __init__(self, name: str, regions: Sequence[tuple[int, int]], memory: Memory = HOST) -> None:
        nixl_agent, nixl_agent_config = _nixl()
        self.name, self.memory = name, memory
        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self._reg = self.agent.get_reg_descs(
            [(ptr, n, memory.device_id, "") for ptr, n in regions], memory.kind)
        self.agent.register_memory(self._reg)
        self._peers: dict[bytes, str] = {}
        self._lock = threading.Lock()  # the agent is shared by every sender/receiver of a rank

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes, expected_name: str | None) -> str:
        """Add a peer from its metadata; the agent it describes must be the one the record that
        carried it named (`expected_name`), else it is removed again and refused."""
        with self._lock:
            name = self._peers.get(metadata)
            if name is None:
                with _as_connection_error("(new)"):
                    name = self.agent.add_remote_agent(metadata)
                name = name.decode() if isinstance(name, bytes) else name
                if name != expected_name and name not in self._peers.values():
                    with contextlib.suppress(Exception):  # noqa: BLE001 - NIXL's own errors
                        self.agent.remove_remote_agent(name)
                elif name == expected_name:
                    self._peers[metadata] = name
            if name != expected_name:
                raise ConnectionError(f"NIXL metadata for agent {name!r} in a record that names "
                                      f"agent {expected_name!r}: refused")
            return name

    def read(self, peer: str, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]],
             notification: bytes, remote_memory: Memory = HOST):
        """Start one READ of remote (addr, len) ranges (in the peer's `remote_memory`) into local
        ones; returns its handle."""
        return self._start("READ", peer, local, remote, notification, remote_memory)

    def write(self, peer: str, local: Sequence[tuple[int, int]],
              remote: Sequence[tuple[int, int]], notification: bytes, remote_memory: Memory = HOST):
        """Start one WRITE of local (addr, len) ranges into remote ones (in the peer's
        `remote_memory`); returns its handle. The peer gets `notification` after the data."""
        return self._start("WRITE", peer, local, remote, notification, remote_memory)

    def _start(self, op: str, peer: str, local: Sequence[tuple[int, int]],
               remote: Sequence[tuple[int, int]], notification: bytes, remote_memory: Memory):
        (kind, device), (remote_kind, remote_device) = self.memory, remote_memory
        with self._lock, _as_connection_error(peer):
            local_d = self.agent.get_xfer_descs([(a, n, device) for a, n in local], kind)
            remote_d = self.agent.get_xfer_descs([(a, n, remote_device) for a, n in remote],
                                                 remote_kind)
            handle = self.agent.initialize_xfer(op, local_d, remote_d, peer, notification)
            if self.agent.transfer(handle) == "ERR":
                self.agent.release_xfer_handle(handle)
                raise ConnectionError(f"NIXL {op} with {peer} could not start")
            return handle

    def state(self, handle) -> str:
        """"PROC", "DONE" or "ERR"."""
        with self._lock:
            try:
                return self.agent.check_xfer_state(handle)
            except Exception:  # noqa: BLE001 - NIXL raises its own error types on a dead peer
                return "ERR"

    def release(self, handle) -> None:
        with self._lock:
            self.agent.release_xfer_handle(handle)

    def notify(self, peer: str, message: bytes) -> None:
        with self._lock, _as_connection_error(peer):
            self.agent.send_notif(peer, message)

    def notifications(self) -> list[tuple[str, bytes]]:
        """(the sending agent's name, the message) of each notification that came: NIXL names
        the agent whose connection carried it (any peer can send any message)."""
        with self._lock:
            notes = self.agent.get_new_notifs()
        return [(name.decode(errors="replace") if isinstance(name, bytes) else str(name), m)
                for name, msgs in notes.items() for m in msgs]

    def close(self) -> None:
        with self._lock:
            try:
                self.agent.deregister_memory(self._reg)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass


class _Lease:
    """One leased room: until when its pages are held, and who may end it."""

    __slots__ = ("until", "cap", "reader", "done_from")

    def __init__(self, until: float, cap: float) -> None:
        self.until, self.cap = until, cap  # wall clock; heartbeats extend `until` up to `cap`
        self.reader: str | None = None     # the agent whose START came first
        self.done_from: list[str] = []     # agents whose DONE came (MAX_EARLY_PER_ROOM at most)


class LeaseTable:
    """Prefill side: room -> lease, fed by the decode's notifications ((agent, message) pairs:
    see the module doc for who may extend and end a lease)."""

    def __init__(self, lease_s: float, max_early: int = MAX_EARLY,
                 max_extension_s: float = MAX_EXTENSION_S) -> None:
        self.lease_s, self.max_early, self.max_extension_s = lease_s, max_early, max_extension_s
        self._rooms: dict[int, _Lease] = {}
        # notifications that came before their room was leased (a fast decode), bounded: a
        # peer naming rooms that never come cannot grow it
        self._early: OrderedDict[int, list[tuple[bytes, str]]] = OrderedDict()
        self._lock = threading.Lock()

    def lease(self, room: int) -> float:
        with self._lock:
            now = time.time()
            lease = self._rooms[room] = _Lease(now + self.lease_s,
                                               now + self.lease_s + self.max_extension_s)
            for kind, agent in self._early.pop(room, ()):  # in the order they came
                self._apply(lease, kind, agent)
            return lease.until

    def feed(self, notes: list[tuple[str, bytes]]) -> None:
        with self._lock:
            for agent, message in notes:
                kind, _, room_b = message.partition(b":")
                if kind not in _KINDS or not 0 < len(room_b) <= 20 or not room_b.isdigit():
                    continue
                room = int(room_b)
                if room >= 2**64 or len(agent) > MAX_AGENT_NAME:
                    continue
                lease = self._rooms.get(room)
                if lease is not None:
                    self._apply(lease, kind, agent)
                    continue
                early = self._early.setdefault(room, [])
                if (kind, agent) not in early and len(early) < MAX_EARLY_PER_ROOM:
                    early.append((kind, agent))
                self._early.move_to_end(room)
                while len(self._early) > self.max_early:
                    self._early.popitem(last=False)

    def _apply(self, lease: _Lease, kind: bytes, agent: str) -> None:
        now = time.time()
        if kind == b"HB":
            lease.until = max(lease.until, min(now + self.lease_s, lease.cap))
        elif kind == b"START":
            # covers a READ started before the cap, never more than MAX_READ_S past it
            lease.until = max(lease.until, min(now + MAX_READ_S, lease.cap + MAX_READ_S))
            if lease.reader is None:
                lease.reader = agent
        elif kind == b"DONE" and agent not in lease.done_from:
            if len(lease.done_from) < MAX_EARLY_PER_ROOM:
                lease.done_from.append(agent)

    def until(self, room: int) -> float:
        with self._lock:
            lease = self._rooms.get(room)
            return lease.until if lease else 0.0

    def reader(self, room: int) -> str | None:
        """The agent the room is bound to (its START came first), if any yet."""
        with self._lock:
            lease = self._rooms.get(room)
            return lease.reader if lease else None

    def status(self, room: int) -> str:
        """"done" (the room's reader read it all), "expired" or "held"."""
        with self._lock:
            lease = self._rooms.get(room)
            if lease is not None and lease.reader is not None and lease.reader in lease.done_from:
                return "done"
            return "expired" if lease is None or time.time() >= lease.until else "held"

    def forget(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)
            self._early.pop(room, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)


# -- push: the WRITE's notification ---------------------------------------------------------------
PUSHED = b"PUSHED"


class PushNote(NamedTuple):
    """What a push prefill tells the decode with its WRITE (NIXL delivers it after the data)."""

    room: int
    started: float  # wall clock: when the WRITE started
    aux: bytes      # the engine's metadata row
    digests: str | None  # the written pages' digests (transfer/page_digests.py); None: not stated


def push_note(room: int, started: float, aux: bytes, digests: str | None) -> bytes:
    """`PUSHED:<room>:<start>:<aux, base64>[:<digests, base64>]` (base64 has no colon)."""
    note = b"%s:%d:%.6f:%s" % (PUSHED, room, started, base64.b64encode(aux))
    return note if digests is None else note + b":" + digests.encode("ascii")


def parse_push_note(message: bytes) -> PushNote | None:
    """A `push_note` (None: not one). The 4-field form of older prefills has no digests."""
    kind, _, rest = message.partition(b":")
    if kind != PUSHED:
        return None
    fields = rest.split(b":")  # none of the fields holds a colon
    if len(fields) not in (3, 4):
        raise ValueError(f"malformed WRITE notification {message[:80]!r}")
    try:
        room, started = int(fields[0]), float(fields[1])
        aux = base64.b64decode(fields[2], validate=True)
        digests = fields[3].decode("ascii") if len(fields) == 4 else None
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"malformed WRITE notification {message[:80]!r}") from None
    return PushNote(room, started, aux, digests)
