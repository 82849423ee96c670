"""The peers' shared secret and request signatures (transfer/peer_auth.py, private_dir.py), on
real files."""

import os
import stat
import time

import pytest

from pd_plugins.transfer import peer_auth
from pd_plugins.transfer.peer_auth import PeerAuthError, RequestVerifier, load_secret
from pd_plugins.transfer.private_dir import PrivateDirError, private_dir


@pytest.fixture(autouse=True)
def clean_env(tmp_path, monkeypatch):
    for name in ("PD_PEER_SECRET", "PD_PEER_SECRET_FILE", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PD_PRIVATE_DIR", str(tmp_path / "private"))


def test_the_default_secret_is_per_host_private_and_stable(tmp_path):
    secret = load_secret()
    path = tmp_path / "private" / "peer-secret"
    assert not secret.explicit and secret.source == str(path) and len(secret.key) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o700
    assert peer_auth._load(None, None) == secret  # another process reads the same one


def test_configured_secrets_come_first(tmp_path, monkeypatch):
    monkeypatch.setenv("PD_PEER_SECRET", "env-secret-0123456789")
    assert load_secret() == peer_auth.PeerSecret(b"env-secret-0123456789", "PD_PEER_SECRET", True)
    path = tmp_path / "secret"
    path.write_text("file-secret-0123456789\n")
    path.chmod(0o600)
    monkeypatch.setenv("PD_PEER_SECRET_FILE", str(path))
    assert load_secret().key == b"file-secret-0123456789" and load_secret().explicit


@pytest.mark.parametrize("problem", ["short", "group-writable", "link-to-writable", "missing"])
def test_a_secret_file_that_cannot_be_trusted_is_refused(tmp_path, monkeypatch, problem):
    path = tmp_path / "secret"
    path.write_text("x" * (4 if problem == "short" else 32))
    path.chmod(0o620 if problem in ("group-writable", "link-to-writable") else 0o600)
    if problem == "link-to-writable":
        os.symlink(path, tmp_path / "link")
        path = tmp_path / "link"
    if problem == "missing":
        path = tmp_path / "nothing"
    monkeypatch.setenv("PD_PEER_SECRET_FILE", str(path))
    with pytest.raises((PeerAuthError, FileNotFoundError), match=str(path)):
        load_secret()


def test_an_operators_secret_file_may_be_a_link_and_world_readable_is_warned(
        tmp_path, monkeypatch, caplog):
    """Kubernetes mounts a Secret's keys as links (key -> ..data/key), mode 0644 by default."""
    (tmp_path / "..data").mkdir()
    target = tmp_path / "..data" / "peer-secret"
    target.write_text("s" * 32)
    target.chmod(0o644)
    os.symlink(target, tmp_path / "peer-secret")
    monkeypatch.setenv("PD_PEER_SECRET_FILE", str(tmp_path / "peer-secret"))
    with caplog.at_level("WARNING", logger="pd_plugins.peer_auth"):
        assert load_secret().key == b"s" * 32
    assert "readable by every local user" in caplog.text


@pytest.mark.parametrize("problem", ["mode", "symlink"])
def test_a_private_dir_someone_else_could_use_is_refused(tmp_path, monkeypatch, problem):
    """Another local user who creates the directory first (or links it elsewhere) gets neither
    our sockets nor our secret."""
    path = tmp_path / "shared"
    if problem == "mode":
        path.mkdir(mode=0o777)
        path.chmod(0o777)
    else:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        os.symlink(tmp_path / "elsewhere", path)
    monkeypatch.setenv("PD_PRIVATE_DIR", str(path))
    with pytest.raises(PrivateDirError, match=str(path)):
        private_dir()


def test_a_pre_created_default_secret_with_loose_mode_is_refused(tmp_path):
    (tmp_path / "private").mkdir(mode=0o700)
    secret = tmp_path / "private" / "peer-secret"
    secret.write_text("y" * 64)
    secret.chmod(0o644)
    with pytest.raises(PeerAuthError, match="mode 600"):
        load_secret()


def test_signatures_cover_everything_and_replies_bind_to_the_request():
    key = b"k" * 32
    verifier = RequestVerifier(key, window_s=5)
    header, nonce = peer_auth.sign_request(key, "PUT", "/a", b"body", "owner-1")
    assert verifier.verify(header, "PUT", "/a", b"body") == ("owner-1", nonce)
    for method, path, body in (("POST", "/a", b"body"), ("PUT", "/b", b"body"),
                               ("PUT", "/a", b"other")):
        fresh, _ = peer_auth.sign_request(key, "PUT", "/a", b"body", "owner-1")
        with pytest.raises(PeerAuthError, match="bad signature"):
            verifier.verify(fresh, method, path, body)
    forged = header.replace("owner-1", "owner-2")
    with pytest.raises(PeerAuthError):
        verifier.verify(forged, "PUT", "/a", b"body")
    future, _ = peer_auth.sign_request(key, "GET", "/a", b"", "o", now=time.time() + 60)
    with pytest.raises(PeerAuthError, match="clock"):
        verifier.verify(future, "GET", "/a", b"", once=False)
    for junk in ("", "a b c", "o 1 nothex " + "0" * 64, "o nan " + "a" * 32 + " " + "0" * 64):
        with pytest.raises(PeerAuthError):
            verifier.verify(junk, "GET", "/a", b"")
    reply = peer_auth.sign_reply(key, nonce, 200, b"{}")
    assert peer_auth.reply_is_authentic(key, nonce, 200, b"{}", reply)
    assert not peer_auth.reply_is_authentic(key, "0" * 32, 200, b"{}", reply)  # another request
    assert not peer_auth.reply_is_authentic(key, nonce, 404, b"{}", reply)
    assert not peer_auth.reply_is_authentic(key, nonce, 200, b"{}", None)


def test_the_replay_memory_is_bounded():
    key = b"k" * 32
    verifier = RequestVerifier(key, max_nonces=10)
    start = time.time()
    headers = [peer_auth.sign_request(key, "PUT", "/a", b"", "o", now=start + i / 1000)[0]
               for i in range(50)]
    for header in headers:
        verifier.verify(header, "PUT", "/a", b"")
    assert len(verifier._seen) == 10
    # a nonce the full table forgot while it was still in the window is not replayable: the
    # requests older than the newest forgotten one are refused
    with pytest.raises(PeerAuthError, match="replayed"):
        verifier.verify(headers[0], "PUT", "/a", b"")
    with pytest.raises(PeerAuthError, match="replayed"):
        verifier.verify(headers[39], "PUT", "/a", b"")
    fresh = peer_auth.sign_request(key, "PUT", "/a", b"", "o", now=start + 1)[0]
    verifier.verify(fresh, "PUT", "/a", b"")  # newer requests still pass


def test_a_non_hex_mac_is_refused_not_raised():
    """hmac.compare_digest raises TypeError on non-ASCII strings (headers arrive as latin-1): a
    peer without the secret gets a refusal, and a forged reply is simply not authentic."""
    key = b"k" * 32
    verifier = RequestVerifier(key)
    header, nonce = peer_auth.sign_request(key, "GET", "/a", b"", "o")
    owner, stamp, _, _ = header.split(" ")
    for mac in ("\xe9" * 64, "A" * 64, "0" * 63):
        with pytest.raises(PeerAuthError, match="malformed"):
            verifier.verify(f"{owner} {stamp} {nonce} {mac}", "GET", "/a", b"", once=False)
        assert not peer_auth.reply_is_authentic(key, nonce, 200, b"{}", mac)
