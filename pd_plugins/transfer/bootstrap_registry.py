"""A prefill's bootstrap registry: where a decode learns how to reach the prefill's KV.

Engine-agnostic: one small HTTP server per prefill instance (SGLang starts it on
`--disaggregation-bootstrap-port`), holding one JSON record per prefill rank, plus the client
calls a decode uses. It doubles as the prefill's liveness signal: a decode that cannot reach it
twice in a row treats the prefill as dead.

    GET  /health              -> 200 "ok" (the only call without authentication)
    PUT  /ranks/<key>         <- {...}: a rank registers (key: "<dp rank>.<engine rank>"); the
                                 first process to register a rank owns it (another gets 409)
    GET  /ranks/<key>         -> {...}, or 404
    PUT  /rooms/<room>.<key>  <- {...}: a transfer is ready to be read (pull backends)
    GET  /rooms/<room>.<key>  -> {...}, or 404 (not ready yet)
    DELETE /rooms/<room>.<key>   (done; the table also forgets the oldest beyond its bounds)

Push backends turn this around: the decode publishes where the prefill may write (a target), and
who owns the decode's pages is settled here, in one place, by a state per target:

    PUT  /targets/<room>.<key>           <- {...}: the decode's pages are open for a write
                                            (409 if the prefill has expired the room)
    POST /targets/<room>.<key>/claim     the prefill will write: 200 {...} (open -> claimed),
                                         404 not published yet, 409 withdrawn or expired
    POST /targets/<room>.<key>/withdraw  the decode gives up: 200 (open -> withdrawn), 409
                                         {"claimed_at": t} when a write may be under way, 404
                                         if the target is not known (evicted: it may have been
                                         claimed)
    POST /targets/<room>.<key>/expire    the prefill gives up: 200 (a target not claimed, or
                                         none yet, becomes expired: a decode that comes later
                                         fails at once), 409 if claimed
    DELETE /targets/<room>.<key>         (done)

A claimed target is never evicted within CLAIM_HOLD_S of its claim (a table full of those refuses
new targets: 503); withdrawn, claimed and expired targets keep a tombstone, not their record.

Trust (docs/security.md): every call but /health is signed with the peers' shared secret
(transfer/peer_auth.py; 401 otherwise) and every answer is signed back, so neither a neighbour
without the secret nor a process that grabbed the port can forge a record. Records belong to the
process that wrote them: a rank's rooms, claims and expiries only to the process that registered
the rank, a target's withdrawal to the decode that published it (403 otherwise). The server binds
PD_BOOTSTRAP_HOST, else the engine's --host; on an address other hosts can reach it refuses to
start without a configured secret (a per-host default secret would lock every other host out).
Bounded: MAX_CONNECTIONS open connections (beyond that the oldest connection of the peer address
holding the most is closed), one thread each, SOCKET_TIMEOUT_S per socket operation, records up
to MAX_RECORD_BYTES, tables by entries and bytes.

The client calls are bounded too, for a decode calls whatever address its request names: a call's
`timeout_s` is its whole duration (connect, send and every read: a peer that trickles bytes cannot
stretch it), and it reads at most MAX_ANSWER_BYTES of answer (RegistryStalled past either).
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import re
import socket
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pd_plugins.transfer import peer_auth
from pd_plugins.transfer.options import host_environment
from pd_plugins.transfer.peer_auth import PeerAuthError, PeerSecret

MAX_RECORD_BYTES = 2 * 1024 * 1024  # a 128k-page room, fully fragmented (transfer/page_runs.py)
MAX_ROOMS = 100_000                 # rooms, and targets, kept (the oldest go first; not a
                                    # target a write may still be landing in: see CLAIM_HOLD_S)
MAX_TABLE_BYTES = 256 * 1024 * 1024  # bytes of records kept per table (the oldest go first)
MAX_RANKS = 4096                    # registered ranks (more are refused: ranks are not evicted)
MAX_CONNECTIONS = 128
SOCKET_TIMEOUT_S = 5.0
# client side: what one call reads of an answer (a record, or a refusal's reason); a call's
# `timeout_s` is its whole duration (connect, send, every read), not each socket operation's
MAX_ANSWER_BYTES = MAX_RECORD_BYTES + 64 * 1024
_KEY = re.compile(r"^/(ranks|rooms|targets)/((?:\d{1,20}\.)?\d{1,6}\.\d{1,6})"
                  r"(?:/(claim|withdraw|expire))?$")
OPEN, CLAIMED, WITHDRAWN, EXPIRED = "open", "claimed", "withdrawn", "expired"
# A claimed target is kept (never evicted) this long after its claim: a WRITE into the decode's
# pages may land until the prefill gives up on it (transfer/nixl_rooms.py MAX_WRITE_S, 30 s), and
# the decode learns from the claim that it must keep its pages until then.
CLAIM_HOLD_S = 120.0


@dataclass(slots=True)
class Entry:
    """A record and the process (owner) that wrote it; push targets also have a state."""

    owner: str
    record: bytes                    # the JSON record, as it was published
    state: str | None = None         # targets: OPEN, CLAIMED, WITHDRAWN or EXPIRED
    claimed_at: float | None = None  # targets: wall clock, once the prefill claimed it

    def pinned(self, now: float) -> bool:
        """A claimed target within CLAIM_HOLD_S of its claim: never evicted."""
        return self.state == CLAIMED and now < (self.claimed_at or 0.0) + CLAIM_HOLD_S


TOMBSTONE = b"{}"  # what a withdrawn, claimed or expired target keeps of its record


class _Table:
    """key -> Entry, bounded by entries and bytes: the oldest go first, except pinned entries
    (claimed targets); `put` refuses what does not fit once only pinned ones are left (or always,
    without `evict`)."""

    def __init__(self, max_entries: int, max_bytes: int, evict: bool = True) -> None:
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.max_entries, self.max_bytes, self.evict, self.bytes = max_entries, max_bytes, evict, 0

    def get(self, key: str) -> Entry | None:
        return self.entries.get(key)

    def put(self, key: str, entry: Entry) -> bool:
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= len(old.record)
        if not self._make_room(1, len(entry.record)):
            if old is not None:  # as it was (at the end: it was just used)
                self.entries[key], self.bytes = old, self.bytes + len(old.record)
            return False
        self.entries[key] = entry
        self.bytes += len(entry.record)
        return True

    def _make_room(self, entries: int, nbytes: int) -> bool:
        """Evict the oldest unpinned entries until `entries` more of `nbytes` fit; False (and
        nothing evicted) if they cannot."""
        def fits(count: int, size: int) -> bool:
            return count + entries <= self.max_entries and size + nbytes <= self.max_bytes

        count, size = len(self.entries), self.bytes
        if fits(count, size):
            return True
        if not self.evict:
            return False
        now, victims = time.time(), []
        for key, entry in self.entries.items():  # oldest first
            if not entry.pinned(now):
                victims.append(key)
                count, size = count - 1, size - len(entry.record)
                if fits(count, size):
                    break
        if not fits(count, size):
            return False
        for key in victims:
            self.pop(key)
        return True

    def shrink(self, key: str) -> None:
        """Keep `key`'s entry, as a tombstone (its record no longer needed)."""
        entry = self.entries[key]
        self.bytes += len(TOMBSTONE) - len(entry.record)
        entry.record = TOMBSTONE

    def pop(self, key: str) -> None:
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= len(old.record)

    def __len__(self) -> int:
        return len(self.entries)


def rank_key(dp_rank: int, engine_rank: int) -> str:
    return f"{int(dp_rank)}.{int(engine_rank)}"


class _Handler(BaseHTTPRequestHandler):
    server: _RegistryHTTPServer
    timeout = SOCKET_TIMEOUT_S  # every read and write on the connection
    _nonce: str | None = None   # the authenticated request's nonce: its answer is signed

    def log_message(self, *args: Any) -> None:  # no access log on stderr
        pass

    def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self._nonce is not None:
            signature = peer_auth.sign_reply(self.server.secret.key, self._nonce, status, body)
            self.send_header(peer_auth.REPLY_HEADER, signature)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, reason: str) -> None:
        self._answer(*_refusal(status, reason))

    def do_GET(self) -> None:
        self._nonce = None  # a kept-alive connection: never sign with the previous request's
        if self.path == "/health":
            return self._answer(200, b"ok", "text/plain")
        return self._serve()

    do_PUT = do_POST = do_DELETE = lambda self: self._serve()  # noqa: E731

    def _serve(self) -> None:
        self._nonce = None  # set once this request authenticates (a connection may carry several)
        body = self._read_body()
        if body is None:
            return None
        match = _KEY.match(self.path)
        table = match and match.group(1)
        if (not match or (table == "ranks") != (match.group(2).count(".") == 1)
                or (self.command == "POST") != bool(match.group(3))
                or (match.group(3) and table != "targets")):
            return self._error(404, f"no such path: {self.command} {self.path[:100]}")
        try:
            owner, self._nonce = self.server.verifier.verify(
                self.headers.get(peer_auth.AUTH_HEADER), self.command, self.path, body,
                once=self.command != "GET")
        except PeerAuthError as exc:
            return self._error(401, str(exc))
        key, action = match.group(2), match.group(3)
        with self.server.lock:  # decide under the lock, answer after it (a slow reader waits alone)
            if self.command == "GET":
                status, answer = self._get(table, key)
            elif self.command == "DELETE":
                status, answer = self._delete(table, key, owner)
            elif self.command == "POST":
                status, answer = self._act(key, action, owner)
            else:
                status, answer = self._put(table, key, owner, body)
        return self._answer(status, answer)

    def _read_body(self) -> bytes | None:
        length = self.headers.get("Content-Length") or "0"
        if not length.isdigit():
            return self._error(400, "Content-Length must be a non-negative integer")
        if int(length) > MAX_RECORD_BYTES:
            self.close_connection = True  # the body is not read
            return self._error(413, f"a record is at most {MAX_RECORD_BYTES} bytes")
        body = self.rfile.read(int(length))
        if len(body) != int(length):
            self.close_connection = True
            return None  # the peer went away (or stalled past the socket timeout)
        return body

    def _rank_owner(self, key: str) -> str | None:
        rank = self.server.tables["ranks"].get(key.split(".", 1)[1])
        return rank.owner if rank else None

    def _not_rank_owner(self, key: str, owner: str, what: str) -> tuple[int, bytes] | None:
        if self._rank_owner(key) == owner:
            return None
        return _refusal(403, f"only the process that registered rank {key.split('.', 1)[1]} "
                             f"may {what}")

    def _get(self, table: str, key: str) -> tuple[int, bytes]:
        entry = self.server.tables[table].get(key)
        if entry is None:
            return _refusal(404, f"{key} is not registered")
        return 200, entry.record

    def _delete(self, table: str, key: str, owner: str) -> tuple[int, bytes]:
        entry = self.server.tables[table].get(key)
        if entry is not None and owner != entry.owner and (
                table != "targets" or owner != self._rank_owner(key)):
            return _refusal(403, f"{table}/{key} belongs to another process")
        self.server.tables[table].pop(key)
        return 200, b"{}"

    def _put(self, table: str, key: str, owner: str, body: bytes) -> tuple[int, bytes]:
        try:
            if not isinstance(json.loads(body), dict):
                raise ValueError("not an object")
        except ValueError as exc:
            return _refusal(400, f"a record is a JSON object of 1 to {MAX_RECORD_BYTES} bytes: "
                                 f"{exc}")
        entries, entry = self.server.tables[table], self.server.tables[table].get(key)
        if table == "ranks":
            if entry is not None and entry.owner != owner:
                # the owner is not named: owners are self-declared, so naming it would let any
                # holder of the secret sign as that prefill (docs/security.md)
                return _refusal(409, f"rank {key} is registered by another process; a rank is "
                                     "registered once")
            if not entries.put(key, Entry(owner, body)):
                return _refusal(409, f"this registry holds {MAX_RANKS} ranks already")
            return 200, b"{}"
        if table == "rooms":
            refused = self._not_rank_owner(key, owner, "publish its rooms")
            if refused:
                return refused
            if _expired_room(entry) and not _expired_room(Entry(owner, body)):
                # a tombstone stays: a publication that arrives late (its client gave up on it)
                # must not bring back a room whose pages the prefill has freed
                return _refusal(409, f"room {key} is {EXPIRED}; a room is published once")
            entries.put(key, Entry(owner, body))
            return 200, b"{}"
        if entry is not None and entry.state in (EXPIRED, CLAIMED, WITHDRAWN):
            # a withdrawn target stays so: a publication that arrives late (the decode's call
            # stalled, and it aborted meanwhile) must not reopen pages the engine has freed
            return _refusal(409, f"target {key} is {entry.state}")
        if entry is not None and entry.state == OPEN and entry.owner != owner:
            return _refusal(409, f"target {key} is published by another process")
        if not entries.put(key, Entry(owner, body, OPEN)):
            # full of targets a write may still be landing in: those are never evicted
            return _refusal(503, f"this registry holds {len(entries)} targets, each claimed "
                                 f"within the last {CLAIM_HOLD_S:.0f} s")
        return 200, b"{}"

    def _act(self, key: str, action: str, owner: str) -> tuple[int, bytes]:
        """A target's state change (push backends), atomic under the registry's lock."""
        targets = self.server.tables["targets"]
        target = targets.get(key)
        state = target.state if target else None
        if action == "withdraw":
            if target is None:  # never published here, or evicted: whether it was claimed is
                return _refusal(404, f"target {key} is not known")  # unknown (the decode waits)
            if state in (OPEN, CLAIMED) and target.owner != owner:
                return _refusal(403, f"target {key} was published by another process")
            if state == CLAIMED:
                return 409, json.dumps({"claimed_at": target.claimed_at}).encode()
            if state == OPEN:
                target.state = WITHDRAWN
                targets.shrink(key)
            return 200, b"{}"
        refused = self._not_rank_owner(key, owner, f"{action} its targets")
        if refused:
            return refused
        if action == "claim":
            if target is None:
                return _refusal(404, f"target {key} is not published")
            if state != OPEN:
                return _refusal(409, f"target {key} is {state}")
            target.state, target.claimed_at = CLAIMED, time.time()
            record = target.record
            targets.shrink(key)  # pinned from now on: CLAIM_HOLD_S
            return 200, record
        if state == CLAIMED:  # expire
            return _refusal(409, f"target {key} is claimed")
        if not targets.put(key, Entry(owner, TOMBSTONE, EXPIRED)):
            return _refusal(503, f"this registry holds {len(targets)} targets, each claimed "
                                 f"within the last {CLAIM_HOLD_S:.0f} s")
        return 200, b"{}"


def _expired_room(entry: Entry | None) -> bool:
    """A pull room's tombstone ({"expired": true}: its prefill gave up and freed its pages)."""
    if entry is None or len(entry.record) > 64:
        return False
    try:
        record = json.loads(entry.record)
    except ValueError:
        return False
    return isinstance(record, dict) and record.get("expired") is True


def _refusal(status: int, reason: str) -> tuple[int, bytes]:
    return status, json.dumps({"error": reason}).encode()


class _RegistryHTTPServer(ThreadingHTTPServer):
    """One thread per connection, at most MAX_CONNECTIONS connections."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024  # a burst of connections waits in the kernel, not in SYN retries

    def __init__(self, address: tuple[str, int], secret: PeerSecret) -> None:
        super().__init__(address, _Handler)
        self.secret, self.verifier = secret, peer_auth.RequestVerifier(secret.key)
        self.tables = {"ranks": _Table(MAX_RANKS, MAX_TABLE_BYTES, evict=False),
                       "rooms": _Table(MAX_ROOMS, MAX_TABLE_BYTES),
                       "targets": _Table(MAX_ROOMS, MAX_TABLE_BYTES)}
        self.lock = threading.Lock()
        self._open: OrderedDict[socket.socket, str] = OrderedDict()  # oldest first -> peer host
        self._open_lock = threading.Lock()

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        with self._open_lock:
            while len(self._open) >= MAX_CONNECTIONS:
                busiest = Counter(self._open.values()).most_common(1)[0][0]
                oldest = next(s for s, host in self._open.items() if host == busiest)
                del self._open[oldest]
                try:  # its thread's blocked read returns at once and the thread ends
                    oldest.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._open[request] = client_address[0]
        super().process_request(request, client_address)

    def shutdown_request(self, request: socket.socket) -> None:
        with self._open_lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def open_connections(self) -> int:
        with self._open_lock:
            return len(self._open)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: loopback if every address it resolves to is
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def registry_host(engine_host: str | None) -> str:
    """Where a prefill's registry binds: PD_BOOTSTRAP_HOST, else the engine's --host."""
    return host_environment().bootstrap_host or engine_host or "127.0.0.1"


def local_address(engine_host: str | None, port: int) -> str:
    """host:port at which a prefill's own ranks reach its registry."""
    host = registry_host(engine_host)
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class BootstrapRegistry:
    """The server, on a daemon thread, bound to `host` (see the module doc for the rules)."""

    def __init__(self, host: str, port: int, secret: PeerSecret | None = None) -> None:
        secret = secret or peer_auth.load_secret()
        if not secret.explicit and not is_loopback(host):
            raise PeerAuthError(
                f"the pd-plugins bootstrap registry would listen on {host}:{port}, reachable "
                "from other hosts, without a configured peer secret: put the same secret on "
                "every prefill and decode host (`openssl rand -hex 32 > FILE; chmod 600 FILE`) "
                "and set PD_PEER_SECRET_FILE=FILE (or PD_PEER_SECRET), or, with every engine on "
                "this host, set PD_BOOTSTRAP_HOST=127.0.0.1 (docs/security.md)")
        self._server = _RegistryHTTPServer((host, port), secret)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,),
                                        daemon=True, name=f"pd-bootstrap-{self.port}")
        self._thread.start()

    def open_connections(self) -> int:
        return self._server.open_connections()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class RegistryUnreachable(ConnectionError):
    pass


class RegistryStalled(RegistryUnreachable):
    """What holds the registry's address did not answer within the call's deadline, or answered
    more than a registry ever does: not a registry that works (a decode calls whatever address
    its request names)."""


class _DeadlineSocket(socket.socket):
    """A connected socket whose every send and receive ends by `deadline` (monotonic): a peer
    that trickles bytes cannot stretch a call past it, as it can a per-operation timeout."""

    deadline = 0.0

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        self.settimeout(left)

    def recv_into(self, *args, **kwargs):
        self._arm()
        return super().recv_into(*args, **kwargs)

    def recv(self, *args, **kwargs):
        self._arm()
        return super().recv(*args, **kwargs)

    def sendall(self, *args, **kwargs):
        self._arm()
        return super().sendall(*args, **kwargs)

    def send(self, *args, **kwargs):
        self._arm()
        return super().send(*args, **kwargs)


class _Connection(http.client.HTTPConnection):
    """One HTTP call to `addr` that ends by `deadline` whatever the peer does (its name is
    resolved by the system's resolver, under that resolver's own timeouts)."""

    def __init__(self, addr: str, deadline: float) -> None:
        super().__init__(addr)
        self.deadline = deadline

    def connect(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        plain = socket.create_connection((self.host, self.port), left)
        sock = _DeadlineSocket(plain.family, plain.type, plain.proto, fileno=plain.detach())
        sock.deadline = self.deadline
        self.sock = sock


def _exchange(method: str, addr: str, path: str, body: bytes | None, headers: dict[str, str],
              timeout_s: float) -> tuple[int, bytes, Any]:
    """(status, answer, headers) of one call, within `timeout_s` in all and at most
    MAX_ANSWER_BYTES of answer; RegistryStalled past either, RegistryUnreachable if it fails."""
    connection = _Connection(addr, time.monotonic() + timeout_s)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        length = response.getheader("Content-Length")
        if length is not None and (not length.strip().isdigit()
                                   or int(length) > MAX_ANSWER_BYTES):
            raise RegistryStalled(f"bootstrap registry {addr} answered {method} {path} with "
                                  f"{length[:40]!r} bytes (at most {MAX_ANSWER_BYTES} are read)")
        data = response.read(MAX_ANSWER_BYTES + 1)
        if len(data) > MAX_ANSWER_BYTES:
            raise RegistryStalled(f"bootstrap registry {addr} answered {method} {path} with more "
                                  f"than {MAX_ANSWER_BYTES} bytes")
        return response.status, data, response.headers
    except RegistryUnreachable:
        raise
    except TimeoutError as exc:
        raise RegistryStalled(f"bootstrap registry {addr} did not answer {method} {path} within "
                              f"{timeout_s:g} s") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise RegistryUnreachable(f"bootstrap registry {addr} unreachable: {exc}") from exc
    finally:
        connection.close()


class RegistryAuthError(RuntimeError):
    """The registry refused this process's signature, or answered without the shared one."""


def _call(method: str, addr: str, path: str, body: bytes | None, timeout_s: float
          ) -> tuple[int, bytes]:
    """One signed call (its answer's signature checked): at most `timeout_s` in all."""
    secret = peer_auth.load_secret()
    auth, nonce = peer_auth.sign_request(secret.key, method, path, body or b"",
                                         peer_auth.process_owner())
    status, data, headers = _exchange(method, addr, path, body, {
        "Content-Type": "application/json", peer_auth.AUTH_HEADER: auth}, timeout_s)
    if not peer_auth.reply_is_authentic(secret.key, nonce, status, data,
                                        headers.get(peer_auth.REPLY_HEADER)):
        if status == 401:
            raise RegistryAuthError(f"bootstrap registry {addr} refused this process: "
                                    f"{data[:300].decode(errors='replace')}")
        raise RegistryAuthError(
            f"bootstrap registry {addr} answered {method} {path} without this host's peer "
            f"secret ({secret.source}): the peers' secrets differ, or another process holds "
            "the port")
    return status, data


def _compact(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode()


def _put(addr: str, table: str, key: str, record: dict, timeout_s: float) -> None:
    status, body = _call("PUT", addr, f"/{table}/{key}", _compact(record), timeout_s)
    if status != 200:
        raise RuntimeError(f"bootstrap registry {addr} refused {table}/{key}: {status} "
                           f"{body[:200]!r}")


def _get(addr: str, table: str, key: str, timeout_s: float) -> dict | None:
    """The record; None if there is none (yet)."""
    status, body = _call("GET", addr, f"/{table}/{key}", None, timeout_s)
    if status == 404:
        return None
    if status != 200:
        raise RuntimeError(f"bootstrap registry {addr}: {status} {body[:200]!r}")
    return json.loads(body)


def register(addr: str, key: str, record: dict, timeout_s: float = 5.0) -> None:
    _put(addr, "ranks", key, record, timeout_s)


def lookup(addr: str, key: str, timeout_s: float = 5.0) -> dict | None:
    return _get(addr, "ranks", key, timeout_s)


def room_key(room: int, rank: str) -> str:
    return f"{int(room)}.{rank}"


def put_room(addr: str, key: str, record: dict, timeout_s: float = 5.0) -> None:
    _put(addr, "rooms", key, record, timeout_s)


def get_room(addr: str, key: str, timeout_s: float = 5.0) -> dict | None:
    return _get(addr, "rooms", key, timeout_s)


def drop_room(addr: str, key: str, timeout_s: float = 5.0) -> None:
    _delete(addr, "rooms", key, timeout_s)


def _delete(addr: str, table: str, key: str, timeout_s: float) -> None:
    _call("DELETE", addr, f"/{table}/{key}", None, timeout_s)


def put_target(addr: str, key: str, record: dict, timeout_s: float = 5.0) -> bool:
    """Publish a decode's target; False if the prefill has expired the room already. True also
    for a target claimed already: a publication whose answer was lost (the call stalled) and that
    the prefill claimed meanwhile (a write may be landing: the decode keeps its pages)."""
    status, body = _call("PUT", addr, f"/targets/{key}", _compact(record), timeout_s)
    expired = status == 409 and f"is {EXPIRED}".encode() in body
    if status == 409 and f"is {CLAIMED}".encode() in body:
        return True
    if status != 200 and not expired:
        raise RuntimeError(f"bootstrap registry {addr} refused target {key}: {status} "
                           f"{body[:200]!r}")
    return not expired


def target_action(addr: str, key: str, action: str, timeout_s: float = 5.0
                  ) -> tuple[int, dict]:
    """claim, withdraw or expire a target: (HTTP status, JSON answer); see the module doc."""
    status, body = _call("POST", addr, f"/targets/{key}/{action}", None, timeout_s)
    if status not in (200, 404, 409):
        raise RuntimeError(f"bootstrap registry {addr}: {action} {key}: {status} {body[:200]!r}")
    return status, json.loads(body or b"{}")


def drop_target(addr: str, key: str, timeout_s: float = 5.0) -> None:
    _delete(addr, "targets", key, timeout_s)


def health(addr: str, timeout_s: float = 2.0) -> bool:
    """Whether `GET /health` answers 200 (unauthenticated); RegistryStalled or
    RegistryUnreachable as every call."""
    return _exchange("GET", addr, "/health", None, {}, timeout_s)[0] == 200


def is_alive(addr: str, timeout_s: float = 2.0) -> bool:
    try:
        return health(addr, timeout_s)
    except RegistryUnreachable:
        return False
