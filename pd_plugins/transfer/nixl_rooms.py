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

    def notifications(self) -> list[bytes]:
        with self._lock:
            return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]

    def close(self) -> None:
        with self._lock:
            try:
                self.agent.deregister_memory(self._reg)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass


class LeaseTable:
    """Prefill side: room -> lease end (wall clock), fed by the decode's notifications."""

    def __init__(self, lease_s: float, max_early: int = MAX_EARLY) -> None:
        self.lease_s, self.max_early = lease_s, max_early
        self._until: dict[int, float] = {}
        self._done: set[int] = set()
        self._started: set[int] = set()
        # notifications that came before their room was leased (a fast decode), bounded: a
        # peer naming rooms that never come cannot grow it
        self._early: OrderedDict[int, set[bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def lease(self, room: int) -> float:
        with self._lock:
            until = time.time() + self.lease_s
            self._until[room] = until
            for kind in sorted(self._early.pop(room, ())):  # DONE, HB, START: order-free
                self._apply(room, kind)
            return self._until[room]

    def feed(self, messages: list[bytes]) -> None:
        with self._lock:
            for message in messages:
                kind, _, room_b = message.partition(b":")
                try:
                    room = int(room_b)
                except ValueError:
                    continue
                if kind not in _KINDS or not 0 <= room < 2**64:
                    continue
                if room in self._until:
                    self._apply(room, kind)
                    continue
                self._early.setdefault(room, set()).add(kind)
                self._early.move_to_end(room)
                while len(self._early) > self.max_early:
                    self._early.popitem(last=False)

    def _apply(self, room: int, kind: bytes) -> None:
        now = time.time()
        if kind == b"HB":
            self._until[room] = max(self._until[room], now + self.lease_s)
        elif kind == b"START":
            self._started.add(room)
            self._until[room] = max(self._until[room], now + MAX_READ_S)
        elif kind == b"DONE":
            self._done.add(room)

    def until(self, room: int) -> float:
        with self._lock:
            return self._until.get(room, 0.0)

    def status(self, room: int) -> str:
        """"done" (the decode read it all), "expired" or "held"."""
        with self._lock:
            if room in self._done:
                return "done"
            return "expired" if time.time() >= self._until.get(room, 0.0) else "held"

    def forget(self, room: int) -> None:
        with self._lock:
            self._until.pop(room, None)
            self._done.discard(room)
            self._started.discard(room)
            self._early.pop(room, None)


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
