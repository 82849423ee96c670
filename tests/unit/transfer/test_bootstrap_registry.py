"""The bootstrap registry over real HTTP on loopback: records, push targets, and its trust
boundary (signed calls and answers, owners, bounds)."""

import http.server
import json
import os
import socket
import threading
import time
import urllib.request

import pytest

from pd_plugins.testing.processes import free_port
from pd_plugins.transfer import bootstrap_registry as br
from pd_plugins.transfer import peer_auth
from pd_plugins.transfer.page_runs import decode_pages, encode_pages


@pytest.fixture(autouse=True)
def own_secret(tmp_path, monkeypatch):
    """Each test gets its own per-host default secret (in its own private directory)."""
    monkeypatch.setenv("PD_PRIVATE_DIR", str(tmp_path / "private"))
    monkeypatch.delenv("PD_PEER_SECRET", raising=False)
    monkeypatch.delenv("PD_PEER_SECRET_FILE", raising=False)
    monkeypatch.delenv("PD_BOOTSTRAP_HOST", raising=False)


@pytest.fixture
def server():
    srv = br.BootstrapRegistry("127.0.0.1", free_port())
    _SERVERS[f"127.0.0.1:{srv.port}"] = srv
    yield srv
    _SERVERS.pop(f"127.0.0.1:{srv.port}", None)
    srv.close()


@pytest.fixture
def registry(server):
    return f"127.0.0.1:{server.port}"


_SERVERS: dict[str, br.BootstrapRegistry] = {}


def registry_server(addr: str):
    """The HTTP server behind `registry` (its tables)."""
    return _SERVERS[addr]._server


def raw(addr: str, method: str, path: str, body: bytes = b"", owner: str = "other-process",
        key: bytes | None = None, auth: str | None = None) -> tuple[int, bytes]:
    """One call signed as `owner` (with this host's secret unless `key`), or with header `auth`."""
    if auth is None:
        auth = peer_auth.sign_request(key or peer_auth.load_secret().key, method, path, body,
                                      owner)[0]
    headers = {peer_auth.AUTH_HEADER: auth} if auth else {}
    request = urllib.request.Request(f"http://{addr}{path}", data=body, method=method,
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_register_and_look_up(registry):
    assert br.is_alive(registry)
    assert br.lookup(registry, br.rank_key(0, 1)) is None
    br.register(registry, br.rank_key(0, 1), {"pool_id": "abc", "scope": "s"})
    assert br.lookup(registry, "0.1") == {"pool_id": "abc", "scope": "s"}


def test_rooms_come_and_go(registry):
    br.register(registry, "0.0", {})
    key = br.room_key(2**62 + 5, br.rank_key(0, 0))
    assert br.get_room(registry, key) is None
    br.put_room(registry, key, {"pages": [1, 2]})
    assert br.get_room(registry, key) == {"pages": [1, 2]}
    br.drop_room(registry, key)
    assert br.get_room(registry, key) is None


@pytest.mark.parametrize("path,body,status", [
    ("/ranks/0.0", b"[1, 2]", 400),          # not an object
    ("/ranks/0.0", b"{not json", 400),
    ("/ranks/x.y", b"{}", 404),               # not a rank key
    ("/ranks/0.0", b"", 400),                 # empty
    ("/rooms/0.0", b"{}", 404),               # a room key has three parts
    ("/ranks/5.0.0", b"{}", 404),             # a rank key has two
])
def test_bad_records_get_a_4xx(registry, path, body, status):
    got, answer = raw(registry, "PUT", path, body)
    assert got == status and "error" in json.loads(answer)


def test_oversized_and_malformed_bodies_get_a_4xx_without_being_read(registry):
    with socket.create_connection(registry.split(":")) as sock:
        sock.sendall(b"PUT /ranks/0.0 HTTP/1.1\r\nContent-Length: %d\r\n\r\n"
                     % (br.MAX_RECORD_BYTES + 1))
        assert sock.recv(100).startswith(b"HTTP/1.0 413")
    with socket.create_connection(registry.split(":")) as sock:
        sock.sendall(b"PUT /ranks/0.0 HTTP/1.1\r\nContent-Length: -5\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.0 400")


def test_an_absent_registry_is_unreachable():
    addr = f"127.0.0.1:{free_port()}"
    assert not br.is_alive(addr, timeout_s=0.5)
    with pytest.raises(br.RegistryUnreachable, match="unreachable"):
        br.lookup(addr, "0.0", timeout_s=0.5)


def test_a_target_is_claimed_once_and_then_cannot_be_withdrawn(registry):
    """Push: the decode's pages belong to whichever side the registry says: a claimed target is
    the prefill's to write (the decode keeps its pages), a withdrawn one is the decode's again."""
    br.register(registry, "0.0", {})
    key = br.room_key(7, "0.0")
    assert br.target_action(registry, key, "claim")[0] == 404  # not published yet
    assert br.put_target(registry, key, {"pages": [4, 5]})
    status, record = br.target_action(registry, key, "claim")
    assert (status, record) == (200, {"pages": [4, 5]})
    assert br.target_action(registry, key, "claim")[0] == 409  # one writer only
    status, answer = br.target_action(registry, key, "withdraw")
    assert status == 409 and answer["claimed_at"] > 0  # a write may be under way: keep the pages
    assert br.target_action(registry, key, "expire")[0] == 409
    br.drop_target(registry, key)
    assert br.target_action(registry, key, "claim")[0] == 404


def test_a_withdrawn_target_cannot_be_claimed(registry):
    br.register(registry, "0.0", {})
    key = br.room_key(8, "0.0")
    assert br.put_target(registry, key, {"pages": [1]})
    assert br.target_action(registry, key, "withdraw")[0] == 200
    status, answer = br.target_action(registry, key, "claim")
    assert status == 409 and "withdrawn" in answer["error"]
    # a publication that lands late (its call stalled; the decode aborted and freed the pages
    # meanwhile) does not reopen the target
    with pytest.raises(RuntimeError, match="withdrawn"):
        br.put_target(registry, key, {"pages": [1]})
    status, answer = br.target_action(registry, key, "claim")
    assert status == 409 and "withdrawn" in answer["error"]


def test_an_expired_room_refuses_a_late_target(registry):
    """The prefill gave up (its lease ran out) before the decode published: the decode learns it
    when it publishes, instead of waiting for a write that will never come."""
    br.register(registry, "0.0", {})
    key = br.room_key(9, "0.0")
    assert br.target_action(registry, key, "expire")[0] == 200
    assert not br.put_target(registry, key, {"pages": [1]})
    assert br.target_action(registry, key, "claim")[0] == 409
    other = br.room_key(10, "0.0")
    assert br.put_target(registry, other, {"pages": [1]})
    assert br.target_action(registry, other, "expire")[0] == 200  # open, not claimed: expired
    assert br.target_action(registry, other, "claim")[0] == 409


@pytest.mark.parametrize("method,path", [
    ("POST", "/targets/1.0.0/steal"),   # not an action
    ("POST", "/rooms/1.0.0/claim"),     # actions are for targets only
    ("POST", "/targets/1.0.0"),         # no action
    ("PUT", "/targets/1.0.0/claim"),    # actions are POSTs
])
def test_bad_target_calls_get_a_404(registry, method, path):
    assert raw(registry, method, path)[0] == 404


# -- trust --------------------------------------------------------------------------------------

def test_unauthenticated_forged_stale_and_replayed_calls_are_refused(registry):
    """Without the shared secret nobody reads a rank's NIXL metadata, or writes or deletes
    anything; a captured call cannot be replayed."""
    br.register(registry, "0.0", {"agent_metadata": "secret-ish"})
    path, body = "/ranks/0.0", b'{"agent_metadata": "forged"}'
    assert raw(registry, "GET", path, auth="")[0] == 401                    # no signature
    assert raw(registry, "PUT", path, body, auth="")[0] == 401
    assert raw(registry, "DELETE", path, auth="")[0] == 401
    assert raw(registry, "PUT", path, body, key=b"k" * 32)[0] == 401        # another secret
    good = peer_auth.sign_request(peer_auth.load_secret().key, "PUT", "/ranks/0.1", b"{}", "x")[0]
    assert raw(registry, "PUT", path, body, auth=good)[0] == 401            # another path
    assert raw(registry, "PUT", "/ranks/0.1", b'{"a": 1}', auth=good)[0] == 401  # another body
    stale = peer_auth.sign_request(peer_auth.load_secret().key, "GET", path, b"", "x",
                                   now=time.time() - 120)[0]
    status, answer = raw(registry, "GET", path, auth=stale)
    assert status == 401 and "clock" in json.loads(answer)["error"]
    assert raw(registry, "PUT", "/ranks/0.1", b"{}", auth=good)[0] == 200
    status, answer = raw(registry, "PUT", "/ranks/0.1", b"{}", auth=good)  # the same call again
    assert status == 401 and "replayed" in json.loads(answer)["error"]
    assert br.lookup(registry, "0.0") == {"agent_metadata": "secret-ish"}


def test_records_belong_to_the_process_that_wrote_them(registry):
    """A rank is registered once (its owner may refresh it); only its owner publishes its rooms,
    claims or expires its targets; only a target's publisher withdraws it."""
    br.register(registry, "0.0", {"agent_name": "prefill-a"})
    br.register(registry, "0.0", {"agent_name": "prefill-a", "refreshed": True})  # same owner
    status, answer = raw(registry, "PUT", "/ranks/0.0", b'{"agent_name": "evil"}')
    assert status == 409 and "registered once" in json.loads(answer)["error"]
    # the owner's name is not told: owners are self-declared, so with it any holder of the secret
    # could sign as that prefill (publish its rooms, claim its targets)
    owner = peer_auth.process_owner()
    assert owner.rsplit(":", 1)[1].encode() not in answer
    assert raw(registry, "DELETE", "/ranks/0.0")[0] == 403
    assert br.lookup(registry, "0.0") == {"agent_name": "prefill-a", "refreshed": True}

    assert raw(registry, "PUT", "/rooms/5.0.0", b'{"pages": [0, 1]}')[0] == 403
    br.put_room(registry, "5.0.0", {"page_runs": [0, 1]})
    assert raw(registry, "DELETE", "/rooms/5.0.0")[0] == 403
    assert br.get_room(registry, "5.0.0") == {"page_runs": [0, 1]}

    # a decode (another process) publishes a target; the prefill (this one) claims it
    assert raw(registry, "PUT", "/targets/6.0.0", b'{"pages": [3]}', owner="decode-1")[0] == 200
    assert raw(registry, "PUT", "/targets/6.0.0", b'{"pages": [9]}', owner="decode-2")[0] == 409
    assert raw(registry, "POST", "/targets/6.0.0/claim", owner="decode-2")[0] == 403
    assert raw(registry, "POST", "/targets/6.0.0/expire", owner="decode-2")[0] == 403
    assert raw(registry, "POST", "/targets/6.0.0/withdraw", owner="decode-2")[0] == 403
    assert br.target_action(registry, "6.0.0", "claim") == (200, {"pages": [3]})
    assert raw(registry, "DELETE", "/targets/6.0.0", owner="decode-2")[0] == 403
    assert raw(registry, "DELETE", "/targets/6.0.0", owner="decode-1")[0] == 200


def test_answers_without_the_secret_are_not_believed():
    """Another process that holds the port (the prefill is down, or not up yet) cannot hand a
    decode a forged rank record."""
    class Forger(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"backend": "pd-nixl", "agent_metadata": "attacker"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    forger = http.server.HTTPServer(("127.0.0.1", 0), Forger)
    threading.Thread(target=forger.serve_forever, daemon=True).start()
    try:
        with pytest.raises(br.RegistryAuthError, match="another process holds the port"):
            br.lookup(f"127.0.0.1:{forger.server_address[1]}", "0.0")
    finally:
        forger.shutdown()
        forger.server_close()


def test_a_registry_other_hosts_can_reach_needs_a_configured_secret(tmp_path, monkeypatch):
    with pytest.raises(peer_auth.PeerAuthError, match="PD_PEER_SECRET_FILE"):
        br.BootstrapRegistry("0.0.0.0", free_port())
    secret = tmp_path / "secret"
    secret.write_text("s3cret-" * 8)
    secret.chmod(0o600)
    monkeypatch.setenv("PD_PEER_SECRET_FILE", str(secret))
    server = br.BootstrapRegistry("0.0.0.0", free_port())
    try:
        addr = br.local_address("0.0.0.0", server.port)
        assert addr == f"127.0.0.1:{server.port}"
        br.register(addr, "0.0", {"ok": True})
        assert br.lookup(addr, "0.0") == {"ok": True}
    finally:
        server.close()


def test_the_bind_address_is_pd_bootstrap_host_else_the_engine_s(monkeypatch):
    assert br.registry_host("10.1.2.3") == "10.1.2.3"
    monkeypatch.setenv("PD_BOOTSTRAP_HOST", "127.0.0.1")
    assert br.registry_host("0.0.0.0") == "127.0.0.1"
    assert br.local_address("10.1.2.3", 5) == "127.0.0.1:5"
    assert br.is_loopback("::1") and br.is_loopback("localhost") and not br.is_loopback("0.0.0.0")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_stalled_connections_hold_bounded_threads_and_memory(server, registry):
    """1,000 connections that never send a byte: the registry keeps at most MAX_CONNECTIONS of
    them (one thread each), and a real client is answered at once meanwhile."""
    br.register(registry, "0.0", {"ok": True})
    threads_before, rss_before = threading.active_count(), _rss_bytes()
    host, port = registry.split(":")
    stalled = [socket.create_connection((host, int(port)), timeout=5) for _ in range(1000)]
    try:
        # accepted after them all; the call's own timeout is the bound (a wall-clock bound
        # tighter than that failed on two busy cores: 1,000 accepts and thread starts)
        assert br.lookup(registry, "0.0", timeout_s=10) == {"ok": True}
        deadline = time.monotonic() + 5  # the threads of closed connections are ending
        while (threading.active_count() - threads_before > br.MAX_CONNECTIONS + 2
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert threading.active_count() - threads_before <= br.MAX_CONNECTIONS + 2
        assert server.open_connections() <= br.MAX_CONNECTIONS
        assert _rss_bytes() - rss_before < 64 * 2**20
        assert br.lookup(registry, "0.0", timeout_s=5) == {"ok": True}
    finally:
        for sock in stalled:
            sock.close()


def test_a_connection_that_never_sends_is_closed_after_the_socket_timeout(registry, monkeypatch):
    monkeypatch.setattr(br._Handler, "timeout", 0.3)
    host, port = registry.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        start = time.monotonic()
        assert sock.recv(100) == b""  # closed by the registry
        assert time.monotonic() - start < 3


@pytest.mark.parametrize("pages", [
    list(range(131_072)),                                # a 128k-token prompt, page size 1
    list(range(10**8, 10**8 + 2 * 131_072, 2)),          # the same, no two pages adjacent
], ids=["contiguous", "fragmented"])
def test_a_128k_page_room_fits_a_record(registry, pages):
    br.register(registry, "0.0", {})
    record = {"page_runs": encode_pages(pages), "aux": "A" * 1000, "lease_until": 1.0}
    assert len(json.dumps(record, separators=(",", ":"))) < br.MAX_RECORD_BYTES
    br.put_room(registry, "1.0.0", record)
    got = br.get_room(registry, "1.0.0")
    assert decode_pages(got["page_runs"], max_pages=len(pages)).tolist() == pages


def test_a_claimed_target_is_never_evicted_and_a_full_registry_refuses_new_ones(registry,
                                                                                 monkeypatch):
    """Targets churn (withdrawn, expired, or any secret holder's): the oldest go, but never a
    claimed one within CLAIM_HOLD_S (a WRITE may be landing in the decode's pages; evicted, the
    decode's withdraw had answered 200, "nobody writes", and it freed them). Full of claimed
    targets, the registry refuses new ones (503); the claimed one is still answered 409 with its
    claim time, and once its hold is over it may go."""
    server = registry_server(registry)
    targets = server.tables["targets"]
    monkeypatch.setattr(targets, "max_entries", 4)
    br.register(registry, "0.0", {})
    key = br.room_key(77, "0.0")
    assert raw(registry, "PUT", f"/targets/{key}", b'{"kv": []}', owner="decode")[0] == 200
    assert br.target_action(registry, key, "claim")[0] == 200  # the WRITE starts
    for room in range(100, 110):
        assert raw(registry, "PUT", f"/targets/{room}.0.0", b"{}", owner="someone")[0] == 200
    assert key in targets.entries and len(targets) == 4
    status, answer = raw(registry, "POST", f"/targets/{key}/withdraw", owner="decode")
    assert status == 409 and json.loads(answer)["claimed_at"] > 0

    for room in range(200, 203):  # every other entry claimed too: nothing may go
        assert raw(registry, "PUT", f"/targets/{room}.0.0", b"{}", owner="decode")[0] == 200
        assert br.target_action(registry, f"{room}.0.0", "claim")[0] == 200
    status, answer = raw(registry, "PUT", "/targets/300.0.0", b"{}", owner="decode")
    assert status == 503 and "claimed" in json.loads(answer)["error"]
    assert raw(registry, "POST", "/targets/301.0.0/expire", owner=peer_auth.process_owner()
               )[0] == 503
    assert len(targets) == 4 and key in targets.entries

    monkeypatch.setattr(br, "CLAIM_HOLD_S", 0.0)  # the holds are over: the oldest go again
    assert raw(registry, "PUT", "/targets/300.0.0", b"{}", owner="decode")[0] == 200
    assert key not in targets.entries and len(targets) == 4


def test_withdrawing_an_unknown_target_is_a_404_and_settled_ones_keep_no_record(registry):
    """A withdraw of a target the registry does not know (never published here, or evicted) is
    not "nobody writes" (200) but 404: the decode cannot tell whether it was claimed. Withdrawn
    and claimed targets keep a tombstone, not their record (their bytes free the table)."""
    server = registry_server(registry)
    targets = server.tables["targets"]
    br.register(registry, "0.0", {})
    assert raw(registry, "POST", "/targets/5.0.0/withdraw", owner="decode")[0] == 404
    record = {"page_runs": list(range(1000))}
    for room, action in ((6, "withdraw"), (7, "claim")):
        key = br.room_key(room, "0.0")
        assert br.put_target(registry, key, record)
        before = targets.bytes
        assert br.target_action(registry, key, action)[0] == 200
        assert targets.get(key).record == br.TOMBSTONE
        assert targets.bytes == before - len(json.dumps(record, separators=(",", ":"))) + 2
    # a publication retried after its answer was lost, once claimed: published (keep the pages)
    assert br.put_target(registry, br.room_key(7, "0.0"), record)


def test_an_expired_room_stays_expired(registry):
    """A pull room's tombstone is kept: a publication that arrives after it (its client gave up
    on a stalled call, and the room failed and was freed meanwhile) must not bring the room back
    for a decode to READ."""
    br.register(registry, "0.0", {})
    key = br.room_key(3, "0.0")
    br.put_room(registry, key, {"page_runs": [1, 2], "lease_until": 5.0})
    br.put_room(registry, key, {"expired": True})
    with pytest.raises(RuntimeError, match="409"):
        br.put_room(registry, key, {"page_runs": [1, 2], "lease_until": 9.0})
    br.put_room(registry, key, {"expired": True})
    assert br.get_room(registry, key) == {"expired": True}


def test_tables_are_bounded_by_entries_and_bytes():
    table = br._Table(max_entries=3, max_bytes=10)
    for i in range(5):
        table.put(str(i), br.Entry("o", b"x"))
    assert list(table.entries) == ["2", "3", "4"] and table.bytes == 3
    table.put("big", br.Entry("o", b"y" * 9))  # over the byte bound: the oldest go
    assert list(table.entries) == ["4", "big"] and table.bytes == 10
    ranks = br._Table(max_entries=1, max_bytes=100, evict=False)
    assert ranks.put("a", br.Entry("o", b"1")) and ranks.put("a", br.Entry("o", b"2"))
    assert not ranks.put("b", br.Entry("o", b"3")) and list(ranks.entries) == ["a"]


def _http_exchange(sock: socket.socket, request: bytes) -> bytes:
    """Send one request; its answer's head and body (AssertionError if the server closes first:
    the socket's timeout bounds a stall)."""
    sock.sendall(request)
    data = b""

    def more() -> bytes:
        chunk = sock.recv(65536)
        assert chunk, f"the registry closed the connection after {data[:200]!r}"
        return chunk

    while b"\r\n\r\n" not in data:
        data += more()
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += more()
    return head + b"\r\n\r\n" + body


def test_a_non_ascii_signature_gets_a_401(registry):
    host, port = registry.split(":")
    auth = b"o 1 " + b"a" * 32 + b" " + b"\xe9" * 64
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        answer = _http_exchange(sock, b"GET /ranks/0.0 HTTP/1.1\r\nHost: x\r\nX-PD-Auth: " + auth
                                + b"\r\nContent-Length: 0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.0 401")



# -- the client: a decode calls whatever address its request names ------------------------------

class _BadRegistry:
    """A TCP server on loopback that answers every connection with `answer(sock)` and counts the
    bytes it sent (until the client closes)."""

    def __init__(self, answer) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = 0
        self._answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(sock,), daemon=True).start()

    def _one(self, sock: socket.socket) -> None:
        with sock:
            sock.recv(65536)
            try:
                self._answer(sock, self)
            except OSError:  # the client went away
                pass

    def send(self, sock: socket.socket, data: bytes) -> None:
        sock.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        self.listener.close()


def _in_thread(call, wait_s: float):
    """(finished, what `call` returned or raised, seconds it took) after at most `wait_s`."""
    got = {}

    def run():
        start = time.monotonic()
        try:
            got["result"] = call()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            got["result"] = exc
        got["took"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(wait_s)
    return not thread.is_alive(), got.get("result"), got.get("took")


@pytest.mark.parametrize("where", ["head", "body"])
def test_a_peer_that_trickles_its_answer_is_cut_at_the_call_s_deadline(where):
    """A byte every 0.1 s: each read returns well within any per-read timeout, so a call's
    timeout must be its whole duration (urllib's was per read: lookup(timeout_s=2) stayed blocked
    past 12 s, on SGLang's scheduler thread)."""
    def trickle(sock, server):
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n"  # a record's size
        if where == "body":
            server.send(sock, head)
        for byte in (head if where == "head" else b"x" * 10**6):
            server.send(sock, bytes([byte]))
            time.sleep(0.1)

    server = _BadRegistry(trickle)
    try:
        for call in (lambda: br.lookup(server.addr, "0.0", timeout_s=1.0),
                     lambda: br.is_alive(server.addr, timeout_s=1.0)):
            finished, result, took = _in_thread(call, wait_s=6)
            assert finished, "the call is still blocked"
            assert took < 2.5, took
            assert result is False or isinstance(result, br.RegistryStalled), result
    finally:
        server.close()


def test_an_answer_larger_than_any_record_is_not_read():
    """A registry answers at most a record (MAX_RECORD_BYTES) or a short refusal: the client
    stops reading past MAX_ANSWER_BYTES, whether the answer says its length or not."""
    chunk = b"x" * 65536

    def flood(sock, server):
        server.send(sock, b"HTTP/1.0 200 OK\r\n\r\n")  # no length: read until the close
        while server.sent < 256 * 2**20:
            server.send(sock, chunk)

    def declared(sock, server):
        server.send(sock, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (512 * 2**20))
        while server.sent < 256 * 2**20:
            server.send(sock, chunk)

    for answer in (flood, declared):
        server = _BadRegistry(answer)
        try:
            finished, result, _ = _in_thread(
                lambda: br.get_room(server.addr, "1.0.0", timeout_s=20), wait_s=30)
            assert finished
            assert isinstance(result, br.RegistryStalled), result
            assert "bytes" in str(result)
            time.sleep(0.2)  # the server's send fails once the client has closed
            # what the client read, and what the kernel's buffers took, is far below the flood
            assert server.sent < br.MAX_ANSWER_BYTES + 16 * 2**20, (answer.__name__, server.sent)
        finally:
            server.close()
