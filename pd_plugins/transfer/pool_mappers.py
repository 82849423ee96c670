"""Which processes map a file, read from /proc/PID/maps (pd-pool and `remove_when_unused`).

Other users' processes are not readable there: `writable_mappers` says so (MappersUnknown) when
the file is open to more than its owner, since then they might map it. Processes in another PID
namespace (another container of the pod, sharing /dev/shm) are not there at all: callers also test
the pool's in-use lock (shm_pool.in_use_elsewhere).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class MappersUnknown(Exception):
    """Some processes could not be read, and the file is shared: whether they map it is unknown."""


@dataclass
class Mapper:
    pid: int
    command: str
    writable: bool


def _command(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(200).replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def mappers(st: os.stat_result) -> tuple[list[Mapper], bool]:
    """The processes whose /proc/PID/maps list the file `st` describes, and whether every
    process's maps could be read (False: some belong to other users)."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    inode = str(st.st_ino)
    found: list[Mapper] = []
    complete = True
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                text = f.read()
        except FileNotFoundError:
            continue  # exited meanwhile
        except OSError:
            complete = False
            continue
        if inode not in text:
            continue
        writable = mapped = False
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) >= 5 and fields[4] == inode and fields[3] == dev:
                mapped = True
                writable |= fields[1][1] == "w"
        if mapped:
            found.append(Mapper(int(pid), _command(pid), writable))
    return found, complete


def writable_mappers(path: str, st: os.stat_result) -> list[Mapper]:
    """Processes that map the pool read-write (its engines). PoolError when some processes could
    not be read and the pool is open to more than its owner (they might map it)."""
    found, complete = mappers(st)
    if not complete and st.st_mode & 0o077 and os.geteuid() != 0:
        raise MappersUnknown(f"KV pool {path} is shared with a group, and other users' processes "
                        "cannot be read here: whether they map it is unknown")
    return [m for m in found if m.writable]
