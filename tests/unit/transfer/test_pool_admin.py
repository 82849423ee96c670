"""pd-pool (pool_admin.py) and remove_when_unused, with real processes mapping real pools.

A pool is in use while a process maps it read-write (an engine); read-only mappers (pd-router's
view) do not keep it. The command runs as a subprocess, as an operator would run it.
"""

import fcntl
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest

from pd_plugins.transfer import pool_admin, shm_pool
from pd_plugins.transfer.shm_pool import ShmKVPool

pytestmark = pytest.mark.processes  # forked engines and pd-pool runs (tests/tiers.py)

SLOT = 4096
CTX = mp.get_context("fork")


@pytest.fixture
def shm_dir(tmp_path):
    """A directory of its own on /dev/shm, so that --all-idle sees only this test's pools."""
    d = f"/dev/shm/pd-admin-{os.getpid()}-{tmp_path.name}"
    os.mkdir(d, 0o700)
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


def make(path, **kw):
    return ShmKVPool(path, slot_bytes=SLOT, layout="admin-test", size_bytes=32 * SLOT,
                     prefault=False, **kw)


def pd_pool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pd_plugins.transfer.pool_admin", *args],
                          capture_output=True, text=True, timeout=120)


def _hold(path, readonly, ready, done, group=None):
    pool = ShmKVPool.attach(path, readonly=readonly) if readonly else make(path, group=group)
    if not readonly:
        pool.reserve([b"k" * 32])  # one slot in use
    ready.set()
    done.wait(60)
    pool.close()


def holder(path, readonly=False, group=None):
    """A process that maps the pool (an engine, or read-only like the router) until told."""
    ready, done = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_hold, args=(path, readonly, ready, done, group))
    proc.start()
    assert ready.wait(60)
    return proc, done


def stop(proc, done):
    done.set()
    proc.join(30)


def test_list_shows_size_slots_users_and_last_use(shm_dir):
    path = f"{shm_dir}/pool-a"
    make(path).close()
    engine, engine_done = holder(path)
    router, router_done = holder(path, readonly=True)
    try:
        out = pd_pool("list", "--json", "--dir", shm_dir)
        assert out.returncode == 0, out.stderr
        [info] = [json.loads(line) for line in out.stdout.splitlines()]
        assert info["path"] == path and info["size"] == 32 * SLOT and not info["error"]
        assert info["num_slots"] > 0 and info["used_slots"] == 1
        assert time.time() - info["last_use"] < 60
        users = {u["pid"]: u["writable"] for u in info["users"]}
        assert users == {engine.pid: True, router.pid: False}
        text = pd_pool("list", path).stdout
        assert f"{engine.pid} (rw)" in text and f"{router.pid} (ro)" in text
    finally:
        stop(engine, engine_done)
        stop(router, router_done)


def test_list_shows_a_pool_shared_with_its_group(shm_dir):
    """A `pool_group` pool (0660 in its group) is a valid pool: pd-pool, which only looks,
    reads it in the file's own group; one that others may read is still refused."""
    path = f"{shm_dir}/pool-group"
    engine = make(path, group=os.getgid())
    try:
        assert os.stat(path).st_mode & 0o777 == 0o660
        [info] = [json.loads(line) for line in pd_pool("list", "--json", path).stdout.splitlines()]
        assert not info["error"] and info["num_slots"] == engine.num_slots
        os.chmod(path, 0o664)
        [info] = [json.loads(line) for line in pd_pool("list", "--json", path).stdout.splitlines()]
        assert "refused" in info["error"]
    finally:
        engine.close()


def test_remove_refuses_a_pool_an_engine_maps_and_removes_it_once_idle(shm_dir):
    path = f"{shm_dir}/pool-b"
    make(path).close()
    engine, done = holder(path)
    out = pd_pool("remove", path)
    assert out.returncode == 1 and f"in use by pid {engine.pid}" in out.stderr
    assert os.path.exists(path)
    stop(engine, done)
    router, router_done = holder(path, readonly=True)  # a reader alone does not keep it
    try:
        out = pd_pool("remove", "--idle-for", "3600", path)
        assert out.returncode == 1 and "s ago" in out.stderr  # used a moment ago
        out = pd_pool("remove", path)
        assert out.returncode == 0, out.stderr
        assert not os.path.exists(path)
    finally:
        stop(router, router_done)


def test_remove_all_idle_takes_only_idle_pools_and_only_pools(shm_dir):
    busy, idle, other = f"{shm_dir}/busy", f"{shm_dir}/idle", f"{shm_dir}/not-a-pool"
    make(busy).close()
    make(idle).close()
    with open(other, "wb") as f:
        f.write(b"x" * 10_000)
    with open(f"{shm_dir}/sem.tiny", "wb") as f:  # a semaphore's size: not a pool either
        f.write(bytes(32))
    engine, done = holder(busy)
    try:
        out = pd_pool("remove", "--all-idle", "--dir", shm_dir)
        assert out.returncode == 0, out.stderr
        assert f"removed {idle}" in out.stdout and f"kept {busy}: in use" in out.stdout
        assert sorted(os.listdir(shm_dir)) == ["busy", "not-a-pool", "sem.tiny"]
        out = pd_pool("remove", other)
        assert out.returncode == 1 and "not a KV pool" in out.stderr and os.path.exists(other)
    finally:
        stop(engine, done)


def test_a_corrupt_pool_is_listed_with_its_error_and_can_be_removed(shm_dir):
    path = f"{shm_dir}/corrupt"
    make(path).close()
    os.truncate(path, 16 * SLOT)
    [info] = [json.loads(line) for line in pd_pool("list", "--json", path).stdout.splitlines()]
    assert "truncated" in info["error"]
    assert pd_pool("remove", path).returncode == 0 and not os.path.exists(path)


@pytest.mark.parametrize("remover", ["pd-pool remove", "remove_when_unused"])
def test_a_pool_an_engine_in_another_pid_namespace_maps_is_not_removed(shm_dir, monkeypatch,
                                                                       remover):
    """Containers of one pod share /dev/shm but not PIDs: an engine in another one is not in this
    /proc. Stand-in for it: a real engine process (here, in this namespace) keeps the pool open
    read-write, while the /proc lookup of this test's process, where pd-pool's `remove` or a
    closing `remove_when_unused` engine runs, is replaced by one that finds nobody
    (`writable_mappers` in pool_admin and shm_pool). Only the engine's in-use lock is left to
    keep its pool."""
    path = f"{shm_dir}/other-namespace"
    make(path).close()
    engine, done = holder(path)
    blind = lambda st: []  # noqa: E731
    monkeypatch.setattr(pool_admin, "writable_mappers", blind)
    monkeypatch.setattr(shm_pool, "writable_mappers", blind)
    try:
        if remover == "pd-pool remove":
            removed, why = pool_admin.remove(path)
            assert not removed and "another PID namespace" in why, why
        else:
            with make(path, remove_when_unused=True):  # an engine here that exits cleanly
                pass
        assert os.path.exists(path)
    finally:
        stop(engine, done)
    with make(path, remove_when_unused=True):  # its own lock does not keep it: the last user
        pass
    assert not os.path.exists(path)


NOBODY = 65534  # uid and gid of `nobody` / `nogroup`


def _run_as_nobody(conn, action, path):
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    try:
        conn.send(action(path))
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        conn.send(repr(exc))


def as_nobody(action, path):
    """`action(path)` in a process of another user (uid and gid 65534), as a user of a pool's
    group runs pd-pool; its result."""
    ours, theirs = CTX.Pipe()
    proc = CTX.Process(target=_run_as_nobody, args=(theirs, action, path))
    proc.start()
    try:
        assert ours.poll(60), "the other user's process did not answer"
        return ours.recv()
    finally:
        proc.join(30)


def _make_group_pool(path):
    make(path, group=NOBODY).close()
    return os.stat(path).st_uid


@pytest.mark.skipif(os.geteuid() != 0, reason="runs pd-pool as another user (needs root)")
def test_a_group_pool_is_removed_by_its_owner_once_no_user_of_its_group_holds_it(shm_dir):
    """`pool_group`: engines of several users share the pool. Its owner's pd-pool cannot read the
    other users' /proc entries (it used to refuse every such pool: only root could remove it);
    the in-use lock shows whether any of them holds it."""
    os.chmod(shm_dir, 0o1777)  # like /dev/shm: anyone creates, a file's owner removes it
    path = f"{shm_dir}/group-pool"
    assert as_nobody(_make_group_pool, path) == NOBODY
    engine, done = holder(path, group=NOBODY)  # an engine of another user of the group (root)
    try:
        removed, why = as_nobody(pool_admin.remove, path)
        assert not removed and "does not show" in why, why
        assert os.path.exists(path)
    finally:
        stop(engine, done)
    assert as_nobody(pool_admin.remove, path) == (True, "")
    assert not os.path.exists(path)


def _open_close(path, remove_when_unused, opened, go):
    pool = make(path, remove_when_unused=remove_when_unused)
    opened.set()
    go.wait(60)
    pool.close()


def test_remove_when_unused_unlinks_when_the_last_engine_closes(shm_dir):
    path = f"{shm_dir}/last-user"
    procs = []
    for _ in range(2):
        opened, go = CTX.Event(), CTX.Event()
        proc = CTX.Process(target=_open_close, args=(path, True, opened, go))
        proc.start()
        assert opened.wait(60)
        procs.append((proc, go))
    stop(*procs[0])
    assert os.path.exists(path)  # the second engine still maps it
    stop(*procs[1])
    assert not os.path.exists(path)


def test_by_default_a_pool_outlives_its_engines(shm_dir):
    path = f"{shm_dir}/kept"
    opened, go = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_open_close, args=(path, False, opened, go))
    proc.start()
    assert opened.wait(60)
    stop(proc, go)
    assert os.path.exists(path)  # a prefix cache that survives restarts


def _open_pool_id(path, out):
    with make(path) as pool:
        st = os.stat(path)
        out.put((pool.file_id() == (st.st_dev, st.st_ino), pool.pool_id))


def _remover(path, locked, go):
    """What `pd-pool remove` does: lock, (check), unlink, unlock. A process of its own: a forked
    engine would otherwise inherit the locked descriptor and keep the lock alive."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    locked.set()
    go.wait(60)
    os.unlink(path)
    os.close(fd)


def test_an_engine_opening_a_pool_while_it_is_removed_ends_up_on_the_new_one(shm_dir):
    """pd-pool removes under the pool's lock; an engine that opened the old file waits for that
    lock, then finds the path gone and makes a new pool there, instead of mapping a file nobody
    else will ever find."""
    path = f"{shm_dir}/race"
    with make(path) as old:
        old_id = old.pool_id
    locked, go, out = CTX.Event(), CTX.Event(), CTX.Queue()
    remover = CTX.Process(target=_remover, args=(path, locked, go))
    remover.start()
    assert locked.wait(60)
    engine = CTX.Process(target=_open_pool_id, args=(path, out))
    engine.start()
    time.sleep(1.0)  # the engine opens the old file and waits for the lock
    go.set()
    same, new_id = out.get(timeout=60)
    engine.join(30)
    remover.join(30)
    assert same and new_id != old_id
