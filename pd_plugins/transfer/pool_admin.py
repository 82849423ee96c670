"""pd-pool: list the host's shared-memory KV pools and remove idle ones.

A pool file (/dev/shm/pd-kv-<model>-<hash> for PdShmConnector, /dev/shm/pd-sglang-kv for SGLang's
pd-shm, or any configured path) outlives the engines that map it, on purpose: it is a prefix cache
that engines share across restarts. But it holds its memory (RAM, for /dev/shm) until it is
removed, and every new model or KV layout makes one more.

    pd-pool list [--json] [--dir DIR] [PATH ...]
    pd-pool remove [--idle-for S] PATH ...
    pd-pool remove --all-idle [--idle-for S] [--dir DIR]

`list` shows each pool's size, slots (in use), the processes mapping it (read-write: engines;
read-only: pd-router's view, pd-pool) and when a slot was last used. `remove` unlinks a pool
only if no process maps it read-write (and, with --idle-for, no slot was used for S seconds);
read-only mappers do not keep a pool (the router maps the new file once engines make one).
Processes that still map a removed file keep their mapping; the memory goes with the last one.

Who maps a pool is read from /proc/PID/maps, where it can be: other users' processes are not
readable there (a group-shared pool, `pool_group`, is open to them), and processes in another
PID namespace (another container of the pod, sharing /dev/shm) are not there at all. So a pool is
also in use while any read-write handle holds its in-use lock (shm_pool.in_use_elsewhere), which
decides for every process /proc does not show. A group-shared pool is listed (mapped read-only)
in the file's own group. The same checks serve `remove_when_unused` (ShmKVPool.close).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import stat
import sys
import time
from dataclasses import asdict, dataclass, field

from pd_plugins.transfer.pool_mappers import Mapper, mappers, writable_mappers
from pd_plugins.transfer.shm_pool import MAGIC, PoolError, ShmKVPool, in_use_elsewhere

DEFAULT_DIRS = ("/dev/shm",)
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass
class PoolInfo:
    path: str
    size: int
    num_slots: int = 0
    used_slots: int = 0
    last_use: float = 0.0
    users: list[Mapper] = field(default_factory=list)
    error: str = ""


def is_pool_file(path: str) -> bool:
    """A regular file (not a link) that starts with the pool's magic. (Nothing else in a shared
    directory is ours to judge: /dev/shm also holds semaphores and other programs' segments.)"""
    try:
        fd = os.open(path, _OPEN)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.pread(fd, len(MAGIC), 0) == MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)


def find_pools(dirs: tuple[str, ...] | list[str] = DEFAULT_DIRS) -> list[str]:
    """Pool files in `dirs` that this user can read (others' pools are theirs to see)."""
    found = []
    for d in dirs:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        found += [p for p in (os.path.join(d, n) for n in names) if is_pool_file(p)]
    return found


def _look_at(path: str, st: os.stat_result) -> ShmKVPool:
    """The pool mapped read-only, for pd-pool to look at. A group-shared pool (`pool_group`:
    0660, no access for others) is accepted in its own group: pd-pool changes nothing, and an
    engine still opens it only in its configured group."""
    shared = stat.S_IMODE(st.st_mode) & 0o070 and not st.st_mode & 0o007
    return ShmKVPool.attach(path, readonly=True, group=st.st_gid if shared else None)


def pool_info(path: str) -> PoolInfo:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        return PoolInfo(path, 0, error=exc.strerror or str(exc))
    info = PoolInfo(path, st.st_size, users=mappers(st)[0])
    try:
        with _look_at(path, st) as pool:
            stats = pool.stats()
            info.num_slots, info.used_slots = stats.num_slots, stats.num_slots - stats.free
            info.last_use = pool.last_use()
    except PoolError as exc:
        info.error = str(exc)
    return info


def remove(path: str, idle_for: float = 0.0) -> tuple[bool, str]:
    """Unlink a pool file if no process maps it read-write and (idle_for) no slot was used for
    that long: (removed, why not). Done under the pool's lock, which engines take before they map
    it: one that opened the file just before sees the path gone once it has the lock, and opens
    again (a new pool)."""
    try:
        fd = os.open(path, _OPEN)
    except OSError as exc:
        return False, f"cannot open: {exc.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False, "not a regular file (a device is not removed)"
        if not is_pool_file(path):
            return False, "not a KV pool (no pool header)"
        if idle_for > 0:  # before our lock: reading it takes the lock through another handle
            last = _last_use(path, st)
            if time.time() - last < idle_for:
                return False, f"used {time.time() - last:.0f} s ago (< {idle_for:g} s)"
        fcntl.flock(fd, fcntl.LOCK_EX)
        busy = writable_mappers(st)
        if busy:  # named where this /proc shows them
            return False, "in use by " + ", ".join(f"pid {m.pid}" for m in busy)
        if in_use_elsewhere(fd):
            return False, ("in use by a process this /proc does not show (it holds the pool's "
                           "in-use lock): another user's, or in another PID namespace (another "
                           "container?)")
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False, "replaced meanwhile"
        os.unlink(path)
        return True, ""
    except FileNotFoundError:
        return False, "already removed"
    except OSError as exc:
        return False, exc.strerror or str(exc)
    finally:
        os.close(fd)  # drops the lock


def _last_use(path: str, st: os.stat_result) -> float:
    """When a slot was last used; the file's change time for a pool whose header is unreadable."""
    try:
        with _look_at(path, st) as pool:
            return pool.last_use()
    except PoolError:
        return max(st.st_mtime, st.st_ctime)


def _ago(t: float) -> str:
    if not t:
        return "-"
    s = max(0.0, time.time() - t)
    return (f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200
            else f"{s / 3600:.1f}h ago")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _owned_by_me(path: str) -> bool:
    try:
        return os.stat(path).st_uid == os.geteuid()
    except FileNotFoundError:  # removed since the scan
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-pool", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="pools, their size, users and last use")
    ls.add_argument("paths", nargs="*", help=f"pool files (default: every pool in {DEFAULT_DIRS})")
    ls.add_argument("--dir", action="append", help="directory to look for pools in (repeatable)")
    ls.add_argument("--json", action="store_true", help="one JSON object per pool")
    rm = sub.add_parser("remove", help="remove pools that no process maps read-write")
    rm.add_argument("paths", nargs="*")
    rm.add_argument("--all-idle", action="store_true", help="every idle pool of this user")
    rm.add_argument("--idle-for", type=float, default=0.0, metavar="S",
                    help="only pools whose slots were not used for S seconds")
    rm.add_argument("--dir", action="append", help="directory for --all-idle (repeatable)")
    args = parser.parse_args(argv)
    dirs = tuple(args.dir or DEFAULT_DIRS)

    if args.command == "list":
        for path in args.paths or find_pools(dirs):
            info = pool_info(path)
            if args.json:
                print(json.dumps(asdict(info)))
                continue
            users = ", ".join(f"{m.pid} ({'rw' if m.writable else 'ro'}) {m.command[:40]}"
                              for m in info.users) or "none"
            slots = f"{info.used_slots}/{info.num_slots} slots used" if info.num_slots else ""
            print(f"{path}  {_size(info.size)}  {slots}  last use {_ago(info.last_use)}  "
                  f"mapped by: {users}" + (f"  [{info.error}]" if info.error else ""))
        return 0

    if not args.paths and not args.all_idle:
        parser.error("remove: give pool paths or --all-idle")
    paths = list(args.paths)
    if args.all_idle:
        paths += [p for p in find_pools(dirs) if _owned_by_me(p)]
    failed = 0
    for path in paths:
        removed, why = remove(path, args.idle_for)
        if removed:
            print(f"removed {path}")
        elif args.all_idle and path not in args.paths:
            print(f"kept {path}: {why}")
        else:
            print(f"not removed {path}: {why}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
