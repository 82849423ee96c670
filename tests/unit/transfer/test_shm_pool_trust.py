"""Who may open a KV pool, and what an unfit region gets: real files on /dev/shm.

A pool holds every prompt's KV, so a file another local user planted at the path (or could read),
a symbolic link, and a truncated or corrupt region are each refused with a PoolError that names
the path: never adopted, never a ValueError, never a SIGBUS.
"""

import os
import stat

import numpy as np
import pytest

from pd_plugins.transfer.shm_pool import (
    MAGIC, SUPERBLOCK_BYTES, PoolError, ShmKVPool, _SUPER_DTYPE, remove_pool,
)

SLOT = 4096
SIZE = 64 * SLOT


@pytest.fixture
def path(tmp_path):
    p = f"/dev/shm/pd-trust-{os.getpid()}-{tmp_path.name}"
    yield p
    if os.path.lexists(p):
        os.unlink(p)


def engine_open(p, **kw):
    return ShmKVPool(p, slot_bytes=SLOT, layout="trust-test", size_bytes=SIZE, prefault=False,
                     **kw)


def make_pool(p) -> bytes:
    with engine_open(p):
        pass
    with open(p, "rb") as f:
        return f.read()


def refused(p, match, **kw):
    """Both an engine (create) and a reader (attach, read-only) refuse it, naming the path."""
    with pytest.raises(PoolError, match=match) as engine:
        engine_open(p, **kw)
    with pytest.raises(PoolError, match=match) as reader:
        ShmKVPool.attach(p, readonly=True, **kw)
    for exc in (engine.value, reader.value):
        assert p in str(exc)


def test_a_file_others_can_read_or_write_is_never_adopted(path):
    """Another local user pre-creates the default path world-writable: refused, left as it is
    (before: opened with O_CREAT and formatted, so that user read and wrote every prompt's KV)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    os.fchmod(fd, 0o666)
    os.close(fd)
    refused(path, "mode 0666: refused")
    st = os.stat(path)
    assert st.st_size == 0 and stat.S_IMODE(st.st_mode) == 0o666  # not touched


def test_a_pool_readable_by_the_group_is_refused_unless_that_group_is_configured(path):
    make_pool(path)
    os.chmod(path, 0o640)
    refused(path, "mode 0640")
    with engine_open(path, group=os.stat(path).st_gid) as pool:  # the operator shares it
        assert pool.num_slots > 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file to another user")
def test_a_pool_owned_by_another_user_is_refused(path):
    make_pool(path)
    os.chown(path, 65534, 65534)  # nobody, mode still 0600
    refused(path, "owned by uid 65534")


def test_symbolic_links_are_refused_and_never_followed(path, tmp_path):
    target = tmp_path / "elsewhere"
    os.symlink(target, path)  # dangling: O_CREAT would have made the target
    refused(path, "symbolic link")
    assert not target.exists()
    os.unlink(path)
    real = f"{path}-real"
    try:
        make_pool(real)
        os.symlink(real, path)  # a link to a good pool of ours: still refused
        refused(path, "symbolic link")
    finally:
        remove_pool(real)


def test_a_fifo_at_the_path_is_refused_without_hanging(path):
    os.mkfifo(path, 0o600)  # opening a FIFO read-only would wait for a writer
    refused(path, "not a regular file")


def test_a_truncated_pool_is_refused_not_a_sigbus(path):
    make_pool(path)
    os.truncate(path, SIZE // 2)
    refused(path, "truncated")
    os.truncate(path, 100)  # shorter than the header
    refused(path, "too small")


@pytest.mark.parametrize("field, value, match", [
    ("magic", b"NOTAPOOL", "not a pd-plugins KV pool"),
    ("version", 99, "format 99"),
    ("flags", 0x80, "unknown flags"),
    ("num_slots", 1 << 40, "truncated or its header is corrupt"),
    ("num_slots", 0, "too small for one"),
    ("slot_bytes", 100, "truncated or its header is corrupt"),
    ("data_offset", 4096, "truncated or its header is corrupt"),
    ("layout", b"\xff\xfe-not-utf8", "corrupt layout"),
])
def test_a_corrupt_superblock_is_a_pool_error_naming_the_path(path, field, value, match):
    make_pool(path)
    with open(path, "r+b") as f:
        sb = np.frombuffer(bytearray(f.read(_SUPER_DTYPE.itemsize)), dtype=_SUPER_DTYPE)
        sb[field] = value
        f.seek(0)
        f.write(sb.tobytes())
    with pytest.raises(PoolError, match=match) as exc:
        ShmKVPool.attach(path, readonly=True)
    assert path in str(exc.value)
    if field != "layout":  # an engine with the right layout is refused as well
        with pytest.raises(PoolError, match=match):
            engine_open(path)


def test_a_blank_file_of_ours_is_a_pool_whose_maker_died_and_is_made_again(path):
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, SIZE)  # sized, header never written
    os.close(fd)
    with pytest.raises(PoolError, match="not a pd-plugins KV pool"):
        ShmKVPool.attach(path, readonly=True)  # a reader never formats
    with engine_open(path) as pool:
        assert pool.num_slots > 0
    with open(path, "r+b") as f:  # but a file with other content is never overwritten
        f.write(b"precious")
    refused(path, "not a pd-plugins KV pool")
    with open(path, "rb") as f:
        assert f.read(8) == b"precious"


def test_a_new_pool_is_private_whatever_the_umask(path):
    old = os.umask(0)
    try:
        with engine_open(path):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_group_pool_is_made_0660_in_that_group(path):
    gid = os.getgid()
    with engine_open(path, group=gid):
        pass
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid
    with pytest.raises(PoolError, match="does not exist"):
        engine_open(path, group="no-such-group-pd")


def test_a_group_pool_gets_its_group_bits_only_once_it_is_in_that_group(path, monkeypatch):
    # created 0660 in the creator's own group (umask 002), then chowned: a member of that group
    # could open it in between and keep a descriptor to every later prompt's KV
    from pd_plugins.transfer import shm_pool

    seen = []
    real_fchmod = os.fchmod

    def watching_fchmod(fd, mode):
        seen.append((stat.S_IMODE(os.fstat(fd).st_mode), mode))
        real_fchmod(fd, mode)

    monkeypatch.setattr(shm_pool.os, "fchmod", watching_fchmod)
    old = os.umask(0o002)
    try:
        with engine_open(path, group=os.getgid()):
            pass
    finally:
        os.umask(old)
    assert seen and seen[0] == (0o600, 0o660)  # private until its group is set


def test_a_failed_creation_leaves_no_file_behind(path):
    with pytest.raises(PoolError, match="too small"):
        ShmKVPool(path, slot_bytes=SLOT, layout="trust-test", size_bytes=2 * SLOT)
    assert not os.path.lexists(path)


def test_a_character_device_goes_the_dax_way(tmp_path):
    """A DAX device is a character device: no owner check (only root makes device nodes), its
    size from sysfs. /dev/null has none: a clear PoolError, not a crash."""
    with pytest.raises(PoolError, match="/dev/null is a character device without a DAX size"):
        ShmKVPool.attach("/dev/null", readonly=True)


def test_a_read_only_handle_maps_read_only_and_cannot_change_the_pool(path):
    with engine_open(path) as engine:
        (ref,) = engine.reserve([b"k" * 32], [7])
        engine.publish([(ref, engine.write(ref, np.ones(SLOT, np.uint8)), SLOT)])
        with ShmKVPool.attach(path, readonly=True) as view:
            assert view.published_content_keys().tolist() == [7]
            assert not view.data.flags.writeable
            with pytest.raises(PoolError, match="read-only"):
                view.reserve([b"x" * 32])
            with pytest.raises(PoolError, match="read-only"):
                view.pin([b"k" * 32])
            perms = _mapping_perms(path)
            assert "r--s" in perms and perms.count("rw-s") == 1  # the engine's, not the view's


def _mapping_perms(p: str) -> list[str]:
    ino = str(os.stat(p).st_ino)
    with open("/proc/self/maps") as f:
        return [line.split()[1] for line in f if len(line.split()) >= 5
                and line.split()[4] == ino]


def test_magic_is_where_the_superblock_says():
    assert _SUPER_DTYPE.fields["magic"][1] == 0 and len(MAGIC) == 8
    assert _SUPER_DTYPE.itemsize <= SUPERBLOCK_BYTES
