"""A prefill's bootstrap registry: where a decode learns how to reach the prefill's KV.

Engine-agnostic: one small HTTP server per prefill instance (SGLang starts it on
`--disaggregation-bootstrap-port`), holding one JSON record per prefill rank, plus the client
calls a decode uses. It doubles as the prefill's liveness signal: a decode that cannot reach it
twice in a row treats the prefill as dead.

    GET  /health              -> 200 "ok"
    PUT  /ranks/<key>         <- {...}: a rank registers (key: "<dp rank>.<engine rank>")
    GET  /ranks/<key>         -> {...}, or 404
    PUT  /rooms/<room>.<key>  <- {...}: a transfer is ready to be read (pull backends)
    GET  /rooms/<room>.<key>  -> {...}, or 404 (not ready yet)
    DELETE /rooms/<room>.<key>   (done; the table also forgets the oldest beyond MAX_ROOMS)

Push backends turn this around: the decode publishes where the prefill may write (a target), and
who owns the decode's pages is settled here, in one place, by a state per target:

    PUT  /targets/<room>.<key>           <- {...}: the decode's pages are open for a write
                                            (409 if the prefill has expired the room)
    POST /targets/<room>.<key>/claim     the prefill will write: 200 {...} (open -> claimed),
                                         404 not published yet, 409 withdrawn or expired
    POST /targets/<room>.<key>/withdraw  the decode gives up: 200 (open -> withdrawn), or 409
                                         {"claimed_at": t} when a write may be under way
    POST /targets/<room>.<key>/expire    the prefill gives up: 200 (a target not claimed, or
                                         none yet, becomes expired: a decode that comes later
                                         fails at once), 409 if claimed
    DELETE /targets/<room>.<key>         (done)
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_RECORD_BYTES = 64 * 1024
MAX_ROOMS = 100_000
_KEY = re.compile(r"^/(ranks|rooms|targets)/((?:\d{1,20}\.)?\d{1,6}\.\d{1,6})"
                  r"(?:/(claim|withdraw|expire))?$")
OPEN, CLAIMED, WITHDRAWN, EXPIRED = "open", "claimed", "withdrawn", "expired"


@dataclass(slots=True)
class Target:
    """A push target: the decode's published record and who owns its pages now."""

    state: str                       # OPEN, CLAIMED, WITHDRAWN or EXPIRED
    record: bytes                    # the decode's JSON record, as it was published
    claimed_at: float | None = None  # wall clock, once the prefill claimed it


def rank_key(dp_rank: int, engine_rank: int) -> str:
    return f"{int(dp_rank)}.{int(engine_rank)}"


class _Handler(BaseHTTPRequestHandler):
    server: _RegistryHTTPServer

    def log_message(self, *args: Any) -> None:  # no access log on stderr
        pass

    def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, reason: str) -> None:
        self._answer(status, json.dumps({"error": reason}).encode())

    def _match(self, action: bool = False) -> re.Match | None:
        match = _KEY.match(self.path)
        if (not match or (match.group(1) == "ranks") != (match.group(2).count(".") == 1)
                or bool(match.group(3)) != action or (action and match.group(1) != "targets")):
            self._error(404, f"no such path: {self.path[:100]}")
            return None
        return match

    def _table(self) -> tuple[OrderedDict, str] | None:
        match = self._match()
        return None if match is None else (getattr(self.server, match.group(1)), match.group(2))

    def do_GET(self) -> None:
        if self.path == "/health":
            return self._answer(200, b"ok", "text/plain")
        found = self._table()
        if found is None:
            return None
        table, key = found
        record = table.get(key)
        if record is None:
            return self._error(404, f"{key} is not registered")
        return self._answer(200, record.record if table is self.server.targets else record)

    def do_POST(self) -> None:
        """A target's state change (push backends), atomic under the registry's lock."""
        match = self._match(action=True)
        if match is None:
            return None
        key, action, targets = match.group(2), match.group(3), self.server.targets
        with self.server.lock:
            target: Target | None = targets.get(key)
            state = target.state if target else None
            if action == "claim":
                if target is None:
                    return self._error(404, f"target {key} is not published")
                if state != OPEN:
                    return self._error(409, f"target {key} is {state}")
                target.state, target.claimed_at = CLAIMED, time.time()
                return self._answer(200, target.record)
            if action == "withdraw":
                if state == CLAIMED:
                    return self._answer(409, json.dumps({"claimed_at": target.claimed_at}).encode())
                if target:
                    target.state = WITHDRAWN
                return self._answer(200, b"{}")
            if state == CLAIMED:  # expire
                return self._error(409, f"target {key} is claimed")
            targets[key] = Target(EXPIRED, b"{}")
            _bound(targets)
            return self._answer(200, b"{}")

    def do_DELETE(self) -> None:
        found = self._table()
        if found is not None:
            found[0].pop(found[1], None)
            self._answer(200, b"{}")

    def do_PUT(self) -> None:
        found = self._table()
        if found is None:
            return None
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_RECORD_BYTES:
            return self._error(400, f"a record is 1 to {MAX_RECORD_BYTES} bytes of JSON")
        body = self.rfile.read(length)
        try:
            if not isinstance(json.loads(body), dict):
                raise ValueError("not an object")
        except ValueError as exc:
            return self._error(400, f"a record is a JSON object: {exc}")
        table, key = found
        with self.server.lock:
            if table is self.server.targets:
                target = table.get(key)
                if target is not None and target.state in (EXPIRED, CLAIMED):
                    return self._error(409, f"target {key} is {target.state}")
                body = Target(OPEN, body)
            table[key] = body
            _bound(table)
        return self._answer(200, b"{}")


def _bound(table: OrderedDict) -> None:
    while len(table) > MAX_ROOMS:
        table.popitem(last=False)


class _RegistryHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    ranks: OrderedDict
    rooms: OrderedDict
    targets: OrderedDict
    lock: threading.Lock


class BootstrapRegistry:
    """The server, on a daemon thread. Bind to the address the decode engines can reach."""

    def __init__(self, host: str, port: int) -> None:
        self._server = _RegistryHTTPServer((host, port), _Handler)
        self._server.ranks, self._server.rooms = OrderedDict(), OrderedDict()
        self._server.targets = OrderedDict()
        self._server.lock = threading.Lock()
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name=f"pd-bootstrap-{self.port}")
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class RegistryUnreachable(ConnectionError):
    pass


def _call(method: str, url: str, body: bytes | None, timeout_s: float) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, urllib.error.URLError) as exc:
        raise RegistryUnreachable(f"bootstrap registry {url} unreachable: {exc}") from exc


def _put(addr: str, table: str, key: str, record: dict, timeout_s: float) -> None:
    status, body = _call("PUT", f"http://{addr}/{table}/{key}", json.dumps(record).encode(),
                         timeout_s)
    if status != 200:
        raise RuntimeError(f"bootstrap registry {addr} refused {table}/{key}: {status} "
                           f"{body[:200]!r}")


def _get(addr: str, table: str, key: str, timeout_s: float) -> dict | None:
    """The record; None if there is none (yet)."""
    status, body = _call("GET", f"http://{addr}/{table}/{key}", None, timeout_s)
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
    _call("DELETE", f"http://{addr}/{table}/{key}", None, timeout_s)


def put_target(addr: str, key: str, record: dict, timeout_s: float = 5.0) -> bool:
    """Publish a decode's target; False if the prefill has expired the room already."""
    status, body = _call("PUT", f"http://{addr}/targets/{key}", json.dumps(record).encode(),
                         timeout_s)
    if status not in (200, 409):
        raise RuntimeError(f"bootstrap registry {addr} refused target {key}: {status} "
                           f"{body[:200]!r}")
    return status == 200


def target_action(addr: str, key: str, action: str, timeout_s: float = 5.0
                  ) -> tuple[int, dict]:
    """claim, withdraw or expire a target: (HTTP status, JSON answer); see the module doc."""
    status, body = _call("POST", f"http://{addr}/targets/{key}/{action}", None, timeout_s)
    if status not in (200, 404, 409):
        raise RuntimeError(f"bootstrap registry {addr}: {action} {key}: {status} {body[:200]!r}")
    return status, json.loads(body or b"{}")


def drop_target(addr: str, key: str, timeout_s: float = 5.0) -> None:
    _delete(addr, "targets", key, timeout_s)


def is_alive(addr: str, timeout_s: float = 2.0) -> bool:
    try:
        return _call("GET", f"http://{addr}/health", None, timeout_s)[0] == 200
    except RegistryUnreachable:
        return False
