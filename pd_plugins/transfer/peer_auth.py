"""Who may talk to our side channels: an HMAC-SHA256 over each request with a shared secret.

The secret, in this order:
- `PD_PEER_SECRET_FILE`: a file holding it (not writable by group or others; a mounted secret);
- `PD_PEER_SECRET`: the secret itself (visible to this user's processes and their children);
- neither: a random per-host secret, created once (0600) as `peer-secret` in this user's
  private directory (transfer/private_dir.py) and shared by this user's processes on this host.
  That serves engines on one host; engines on several hosts need the same configured secret
  (`explicit` tells the two apart, and a server reachable from other hosts refuses to start
  without one).
A secret is at least 16 bytes (surrounding whitespace is dropped); `openssl rand -hex 32` makes one.

Requests carry `X-PD-Auth: <owner> <unix time> <nonce> <mac>`, the MAC over the method, path,
owner, time, nonce and body: a request is refused if its time is more than REPLAY_WINDOW_S off
(hosts need synchronised clocks) and a state-changing one also if its nonce was seen before.
`owner` names the process that sent it (the registry keeps records per owner). Replies carry
`X-PD-Auth-Reply: <mac>` over the request's nonce, the status and the body, so a client can tell
its server's answers from those of whoever else holds the port.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import socket
import stat
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from pd_plugins.transfer.options import host_environment
from pd_plugins.transfer.private_dir import private_dir

log = logging.getLogger("pd_plugins.peer_auth")

AUTH_HEADER = "X-PD-Auth"
REPLY_HEADER = "X-PD-Auth-Reply"
REPLAY_WINDOW_S = 30.0
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
MAX_NONCES = 200_000  # state-changing requests remembered within the replay window
_OWNER = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_NONCE = re.compile(r"^[0-9a-f]{32}$")
_MAC = re.compile(r"[0-9a-f]{64}")  # hex SHA-256 (compare_digest raises on non-ASCII strings)


class PeerAuthError(RuntimeError):
    """A request or reply that does not authenticate, or a secret that cannot be used."""


@dataclass(frozen=True)
class PeerSecret:
    key: bytes
    source: str      # where it came from, for messages (never the secret itself)
    explicit: bool   # configured by the operator (PD_PEER_SECRET_FILE / PD_PEER_SECRET)


_cache: dict[tuple, PeerSecret] = {}
_cache_lock = threading.Lock()


def load_secret() -> PeerSecret:
    """The secret by the rules in the module doc (cached per configuration)."""
    env = host_environment()
    config = (env.peer_secret_file, env.peer_secret, env.private_dir,
              os.environ.get("XDG_RUNTIME_DIR"))
    with _cache_lock:
        if config not in _cache:
            _cache[config] = _load(*config[:2])
        return _cache[config]


def _load(path: str | None, value: str | None) -> PeerSecret:
    if path:
        return PeerSecret(_checked(_read_secret_file(path, private=False), path), path, True)
    if value:
        return PeerSecret(_checked(value.encode(), "PD_PEER_SECRET"), "PD_PEER_SECRET", True)
    path = os.path.join(private_dir(), "peer-secret")
    try:
        return PeerSecret(_read_secret_file(path, private=True), path, False)
    except FileNotFoundError:
        pass
    # create it whole, then link it into place: a racing process reads either nothing or all
    temp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    try:
        os.link(temp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(temp)
    return PeerSecret(_read_secret_file(path, private=True), path, False)


def _read_secret_file(path: str, private: bool) -> bytes:
    try:
        # The per-host secret is ours: never through a link. An operator's file may be one
        # (Kubernetes mounts a Secret's keys as links into ..data/): its target is checked.
        fd = os.open(path, os.O_RDONLY | (os.O_NOFOLLOW if private else 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise PeerAuthError(f"cannot read the peer secret file {path}: {exc}") from exc
    try:
        info = os.fstat(fd)  # the file opened, whatever link led to it
        if private and (not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid()
                        or info.st_mode & 0o077):
            raise PeerAuthError(f"refusing the per-host peer secret {path}: not a regular file "
                                "owned by this user with mode 600; remove it (it is recreated)")
        if not private and (not stat.S_ISREG(info.st_mode) or info.st_mode & 0o022):
            raise PeerAuthError(f"refusing the peer secret file {path}: not a regular file, or "
                                "writable by group or others (chmod 600 it)")
        if not private and info.st_mode & 0o004:
            log.warning("the peer secret file %s is readable by every local user, who can then "
                        "sign registry calls: chmod 600 it (Kubernetes: defaultMode 0400)", path)
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    return _checked(data, path)


def _checked(key: bytes, source: str) -> bytes:
    key = key.strip()
    if not MIN_SECRET_BYTES <= len(key) <= MAX_SECRET_BYTES:
        raise PeerAuthError(f"the peer secret from {source} must be {MIN_SECRET_BYTES} to "
                            f"{MAX_SECRET_BYTES} bytes (for example `openssl rand -hex 32`)")
    return key


_owner: tuple[int, str] | None = None


def process_owner() -> str:
    """This process's owner name: host, pid and a random part (a restarted process is another)."""
    global _owner
    if _owner is None or _owner[0] != os.getpid():
        host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64] or "host"
        _owner = (os.getpid(), f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}")
    return _owner[1]


def _mac(key: bytes, *parts: str, body: bytes = b"") -> str:
    message = "\n".join(parts).encode() + b"\n" + body
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign_request(key: bytes, method: str, path: str, body: bytes, owner: str,
                 now: float | None = None) -> tuple[str, str]:
    """(X-PD-Auth header value, its nonce: what the reply's MAC covers)."""
    if not _OWNER.match(owner):
        raise ValueError(f"an owner name is 1 to 128 of [A-Za-z0-9._:-], not {owner!r}")
    stamp, nonce = f"{time.time() if now is None else now:.3f}", uuid.uuid4().hex
    mac = _mac(key, method, path, owner, stamp, nonce, body=body)
    return f"{owner} {stamp} {nonce} {mac}", nonce


def sign_reply(key: bytes, nonce: str, status: int, body: bytes) -> str:
    return _mac(key, "reply", nonce, str(status), body=body)


def reply_is_authentic(key: bytes, nonce: str, status: int, body: bytes,
                       header: str | None) -> bool:
    return (bool(header) and _MAC.fullmatch(header) is not None
            and hmac.compare_digest(sign_reply(key, nonce, status, body), header))


class RequestVerifier:
    """Server side: checks X-PD-Auth, the time window and (state changes) replays."""

    def __init__(self, key: bytes, window_s: float = REPLAY_WINDOW_S,
                 max_nonces: int = MAX_NONCES) -> None:
        self.key, self.window_s, self.max_nonces = key, window_s, max_nonces
        # nonce -> (when it may be forgotten, the request's own time)
        self._seen: OrderedDict[str, tuple[float, float]] = OrderedDict()
        # The newest request time among nonces forgotten while still replayable (the table was
        # full): a request not newer than that cannot be checked for replay, so it is refused.
        self._floor = float("-inf")
        self._lock = threading.Lock()

    def verify(self, header: str | None, method: str, path: str, body: bytes,
               once: bool = True) -> tuple[str, str]:
        """(owner, nonce) of an authentic request; PeerAuthError with the reason otherwise.
        `once`: the request changes state, so the same nonce is refused a second time."""
        if not header:
            raise PeerAuthError(f"no {AUTH_HEADER} header: set the same PD_PEER_SECRET_FILE "
                                "(or PD_PEER_SECRET) on every engine")
        fields = header.split(" ")
        if (len(fields) != 4 or not _OWNER.fullmatch(fields[0]) or not _NONCE.fullmatch(fields[2])
                or not _MAC.fullmatch(fields[3])):
            raise PeerAuthError(f"malformed {AUTH_HEADER} header")
        owner, stamp, nonce, mac = fields
        expected = _mac(self.key, method, path, owner, stamp, nonce, body=body)
        if not hmac.compare_digest(expected, mac):
            raise PeerAuthError("bad signature: the peers do not share one secret "
                                "(PD_PEER_SECRET_FILE / PD_PEER_SECRET)")
        try:
            skew = abs(time.time() - float(stamp))
        except ValueError:
            raise PeerAuthError(f"malformed {AUTH_HEADER} time") from None
        if not skew <= self.window_s:  # also refuses nan
            raise PeerAuthError(f"request time is {skew:.0f} s off this host's clock (at most "
                                f"{self.window_s:.0f} s: synchronise the clocks)")
        if once:
            self._remember(nonce, float(stamp))
        return owner, nonce

    def _remember(self, nonce: str, stamp: float) -> None:
        now = time.monotonic()
        with self._lock:
            while self._seen and next(iter(self._seen.values()))[0] < now:
                self._seen.popitem(last=False)
            if nonce in self._seen or stamp <= self._floor:
                raise PeerAuthError("replayed request (its nonce was seen before, or it is older "
                                    "than the replay memory reaches)")
            self._seen[nonce] = (now + 2 * self.window_s, stamp)
            while len(self._seen) > self.max_nonces:
                self._floor = max(self._floor, self._seen.popitem(last=False)[1][1])
