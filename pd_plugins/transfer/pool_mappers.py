"""Which processes map a file, read from /proc/PID/maps (pd-pool and `remove_when_unused`).

What /proc does not show, callers learn from the pool's in-use lock (shm_pool.in_use_elsewhere),
which every read-write handle holds: other users' processes (their maps are not readable here;
a `pool_group` pool is open to them) and processes in another PID namespace (another container
of the pod, sharing /dev/shm). /proc names the processes it can see.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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


def writable_mappers(st: os.stat_result) -> list[Mapper]:
    """The processes /proc shows mapping the pool read-write (its engines)."""
    return [m for m in mappers(st)[0] if m.writable]
