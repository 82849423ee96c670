"""Lease checks: a pull-mode reader learns whether the blocks it read were still leased to it.

In pull mode the decode READs the prefill's KV blocks with a one-sided transfer; the prefill learns
of the read only from the completion notification the transfer carries. If the prefill's lease on
the blocks ran out first, it freed them, and by the time the read ran they may hold another
request's KV: the decode read garbage and nothing on its side can tell.

The prefill can tell. When the notification arrives it still holds the blocks or it does not; the
notification follows the data, and a request's blocks are freed once, so "still held at the
notification" means "held throughout the read". The prefill records that verdict per (request,
reader, prefill rank); the reader asks for it before it uses the data, saying how many of the
prefill's TP ranks it read from (a TP 1 decode reads a TP 2 prefill's two head halves, one
notification each), and only a verdict from every one of them makes it ok: ok -> use it; late -> a failed load (the
engine recomputes or fails the request); no verdict by the deadline -> a failed load as well
(fail closed). A late notification that is really on time only costs a recompute.

The prefill also records when it released a request's blocks. A reader with no verdict by then
was late: an on-time notification is handled no later than the release it causes. So an idle
prefill that has stopped handling notifications still answers at once.

Engine-agnostic: pyzmq and msgspec only. The prefill side runs a `LeaseCheckServer`; the reader
side holds finished reads in a `LateReadGuard` until their verdicts arrive.

Exposure: the server binds the address it is given (PdNixlConnector: its NIXL side-channel host,
the address decodes already reach). Queries only read the bounded verdict table, so they are not
authenticated; what a peer can make the server hold is bounded: a query is at most
MAX_MESSAGE_BYTES (bigger ones are dropped by ZMQ), each connection queues at most HWM messages
each way (replies beyond that are dropped, the asker times out), a connection that does not
complete ZMQ's handshake within HANDSHAKE_S or stops answering heartbeats is closed, and the
number of connections is bounded by the process's file limit. The reader keeps sockets to at most
MAX_ENDPOINTS prefills (an idle one, least recently used, is closed for a new one; with none idle a
query waits, and its read fails closed at its deadline).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import zmq

from pd_plugins.transfer.signature_channel import bounded_socket

Verdict = Literal["ok", "late", "pending"]
# reader side: where and what to ask (host, port, the prefill's request id, its ranks read)
LeaseCheck = tuple[str, int, str, int]

MAX_VERDICTS = 100_000          # prefill side: verdicts kept for readers that have yet to ask
CHECK_TIMEOUT_S = 10.0          # reader side: no verdict by then -> the read counts as late
RETRY_INTERVAL_S = 0.002        # reader side: re-ask a "pending" verdict this often
REPLY_WAIT_S = 0.005            # reader side: how long one poll waits for replies
MAX_MESSAGE_BYTES = 16 * 1024  # a query or a reply (a request id may come from a client header)
# A request id plus reader name a lease check carries: a read of a longer one fails closed, and
# the prefill records no verdict for one (its table holds 100,000 entries: about 100 MB at most)
MAX_ID_BYTES = 1024


def checkable(request_id: bytes | str, reader: bytes | str) -> bool:
    """Whether a lease check can carry this request id and reader name."""
    return len(request_id) + len(reader) <= MAX_ID_BYTES  # bytes, or ASCII as ids are
HWM = 256                       # messages queued per connection, each way
HANDSHAKE_S = 5.0               # a connection must complete ZMQ's handshake by then
HEARTBEAT_S = 5.0               # ZMQ heartbeats; a peer silent for 3 of them is dropped
MAX_ENDPOINTS = 64              # reader side: prefills it keeps a socket to
MAX_RANKS = 1024                # a query naming more prefill ranks than this is never ok


class VerdictTable:
    """(request id, reader) -> per prefill rank, whether the reader's read from that rank finished
    while the blocks were leased.

    Bounded: the oldest verdicts go first (a reader that asks after that gets no verdict and
    fails closed).
    """

    def __init__(self, max_entries: int = MAX_VERDICTS) -> None:
        self._verdicts: OrderedDict[tuple[str, str], dict[int, bool]] = OrderedDict()
        self._released: OrderedDict[str, None] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()

    def release(self, request_id: str) -> None:
        """The prefill freed the request's blocks; record verdicts of the same step first."""
        with self._lock:
            self._released[request_id] = None
            while len(self._released) > self._max_entries:
                self._released.popitem(last=False)

    def record(self, request_id: str, reader: str, on_time: bool, rank: int = 0) -> None:
        """`rank`: the prefill's TP rank whose worker saw the notification (its own engine's
        ranks only, so at most its TP size per key)."""
        with self._lock:
            key = (request_id, reader)
            ranks = self._verdicts.setdefault(key, {})
            # A reader that notifies twice (retried transfer) stays late once it was late.
            ranks[rank] = on_time and ranks.get(rank, True)
            self._verdicts.move_to_end(key)
            while len(self._verdicts) > self._max_entries:
                self._verdicts.popitem(last=False)

    def lookup(self, request_id: str, reader: str, ranks: int = 1) -> Verdict:
        """ok once `ranks` of the prefill's ranks said on time and none said late."""
        with self._lock:
            seen = dict(self._verdicts.get((request_id, reader), {}))
            released = request_id in self._released
        if not all(seen.values()):
            return "late"
        if len(seen) >= ranks:
            return "ok"
        # The release follows every rank's notification of an on-time read (the engine frees a
        # request's blocks only when all its workers finished sending): a missing one was late.
        return "late" if released else "pending"

    def __len__(self) -> int:
        return len(self._verdicts)


# Wire format (one ZMQ frame each way, msgpack): query [query_id, request_id, reader, ranks];
# reply [query_id, verdict].
_Query = tuple[int, str, str, int]
_Reply = tuple[int, str]


class LeaseCheckServer:
    """Answers lease-check queries from readers (a ZMQ ROUTER socket on its own thread)."""

    def __init__(self, host: str, port: int = 0, table: VerdictTable | None = None) -> None:
        self.table = table or VerdictTable()
        self._socket = _bounded_tcp_socket(zmq.ROUTER)
        address = f"tcp://{host}:{port}" if port else f"tcp://{host}:*"
        self._socket.bind(address)
        self.port = int(self._socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pd-lease-check", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(_Query)
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            while True:
                try:
                    identity, payload = self._socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except ValueError:  # wrong frame count: not one of ours
                    continue
                try:
                    query_id, request_id, reader, ranks = decoder.decode(payload)
                except msgspec.DecodeError:
                    continue  # malformed query: no answer, the asker times out
                verdict = (self.table.lookup(request_id, reader, ranks)
                           if 0 < ranks <= MAX_RANKS else "late")
                self._socket.send_multipart([identity, encoder.encode((query_id, verdict))])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close()


def _bounded_tcp_socket(kind: int) -> zmq.Socket:
    sock = bounded_socket(kind, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * HEARTBEAT_S * 1000))
    return sock


Endpoint = tuple[str, int]  # (host, port) of a LeaseCheckServer


@dataclass
class _HeldRead:
    endpoint: Endpoint
    request_id: str  # the prefill's id for the request (what its notification names)
    deadline: float
    ranks: int = 1  # how many of the prefill's TP ranks the read came from
    query_id: int | None = None  # the query in flight, if any
    ask_after: float = 0.0


@dataclass
class GuardResult:
    on_time: set[str] = field(default_factory=set)   # reads to use
    late: set[str] = field(default_factory=set)      # the prefill had released the blocks
    timed_out: set[str] = field(default_factory=set)  # no verdict by the deadline


class LateReadGuard:
    """Reader side: holds finished reads until their prefill's verdict says the data is valid.

    Keys are the reader's own request ids; `reader` is this reader's transfer agent name, the
    name the prefill sees on the notification. Used from one thread (the engine's step loop).
    """

    def __init__(self, reader: str, check_timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.reader = reader
        self.check_timeout_s = check_timeout_s
        self._held: dict[str, _HeldRead] = {}
        self._by_query: dict[int, str] = {}
        self._query_ids = itertools.count()
        self._sockets: OrderedDict[Endpoint, zmq.Socket] = OrderedDict()  # least recent first
        self._poller = zmq.Poller()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(_Reply)

    def hold(self, key: str, endpoint: Endpoint, request_id: str, now: float | None = None,
             ranks: int = 1) -> None:
        """`ranks`: how many of the prefill's TP ranks this reader read from (prefill TP over
        decode TP when the prefill's is larger, else 1)."""
        now = time.monotonic() if now is None else now
        if not checkable(request_id.encode(), self.reader.encode()):
            # no verdict is recorded for it (and ZMQ would drop a message too large): fail closed
            self._held[key] = _HeldRead(endpoint, request_id, deadline=now, ask_after=math.inf)
            return
        self._held[key] = _HeldRead(endpoint, request_id, deadline=now + self.check_timeout_s,
                                    ranks=ranks)

    def held(self) -> set[str]:
        return set(self._held)

    def poll(self, wait_s: float = REPLY_WAIT_S) -> GuardResult:
        """Ask for missing verdicts, collect replies (waiting up to wait_s), expire the overdue."""
        result = GuardResult()
        if not self._held:
            return result
        self._send_queries(time.monotonic())
        deadline = time.monotonic() + wait_s
        while self._by_query:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(self._poller.poll(remaining_ms))
            if not ready:
                break
            for sock in ready:
                self._read_replies(sock, result)
            if not self._by_query or time.monotonic() >= deadline:
                break
        now = time.monotonic()
        for key, held in list(self._held.items()):
            if now >= held.deadline:
                self._drop(key)
                result.timed_out.add(key)
        return result

    def _send_queries(self, now: float) -> None:
        for key, held in self._held.items():
            if held.query_id is not None or now < held.ask_after:
                continue
            held.query_id = next(self._query_ids)
            self._by_query[held.query_id] = key
            query = (held.query_id, held.request_id, self.reader, held.ranks)
            sock = self._socket(held.endpoint)
            try:
                if sock is None:
                    raise zmq.Again()
                sock.send(self._encoder.encode(query), zmq.NOBLOCK)
            except zmq.Again:  # queue full, or no socket free yet: ask again next poll
                self._by_query.pop(held.query_id)
                held.query_id = None

    def _read_replies(self, sock: zmq.Socket, result: GuardResult) -> None:
        while True:
            try:
                query_id, verdict = self._decoder.decode(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            except msgspec.DecodeError:
                continue
            key = self._by_query.get(query_id)
            if key is None or key not in self._held:
                self._by_query.pop(query_id, None)
                continue  # an answer to a query whose read was already settled
            held = self._held[key]
            if self._sockets.get(held.endpoint) is not sock:
                continue  # not from the endpoint asked: another prefill cannot settle this read
            del self._by_query[query_id]
            held.query_id = None
            if verdict == "pending":
                held.ask_after = time.monotonic() + RETRY_INTERVAL_S
                continue
            self._drop(key)
            (result.on_time if verdict == "ok" else result.late).add(key)

    def _drop(self, key: str) -> None:
        held = self._held.pop(key)
        if held.query_id is not None:
            self._by_query.pop(held.query_id, None)

    def _socket(self, endpoint: Endpoint) -> zmq.Socket | None:
        """The socket to `endpoint`; None while MAX_ENDPOINTS sockets all serve held reads (the
        query waits for one to become idle, or for its deadline)."""
        sock = self._sockets.get(endpoint)
        if sock is not None:
            self._sockets.move_to_end(endpoint)
            return sock
        if len(self._sockets) >= MAX_ENDPOINTS:
            busy = {held.endpoint for held in self._held.values()}
            idle = next((e for e in self._sockets if e not in busy), None)
            if idle is None:
                return None
            self._poller.unregister(self._sockets[idle])
            self._sockets.pop(idle).close()
        sock = _bounded_tcp_socket(zmq.DEALER)
        host, port = endpoint
        sock.connect(f"tcp://{host}:{port}")
        self._poller.register(sock, zmq.POLLIN)
        self._sockets[endpoint] = sock
        return sock

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
