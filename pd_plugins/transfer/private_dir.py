"""A per-user private directory (mode 0700) for this host's side-channel sockets and secrets.

ZMQ ipc sockets and the default peer secret (transfer/peer_auth.py) live here, not directly in
/tmp: there another local user could create the path first (and receive a worker's lookups, or
feed it answers) or read what is written. `$XDG_RUNTIME_DIR/pd-plugins` when the session has a
runtime dir, else `<tmp>/pd-plugins-<uid>`; `PD_PRIVATE_DIR` names another. An existing directory
is used only if it is a real directory (not a symlink) owned by this user with no group or other
access; anything else is refused with an error naming the path.
"""

from __future__ import annotations

import os
import stat
import tempfile

from pd_plugins.transfer.options import host_environment


class PrivateDirError(RuntimeError):
    pass


def private_dir() -> str:
    path = host_environment().private_dir
    if not path:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        path = (os.path.join(runtime, "pd-plugins") if runtime and os.path.isdir(runtime)
                else os.path.join(tempfile.gettempdir(), f"pd-plugins-{os.geteuid()}"))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise PrivateDirError(f"cannot create the private directory {path}: {exc}") from exc
    check_private(path, want_dir=True)
    return path


def check_private(path: str, want_dir: bool = False) -> os.stat_result:
    """lstat `path` and refuse it unless it is ours, not a symlink, and closed to group/other."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise PrivateDirError(f"{path}: {exc}") from exc
    kind_ok = stat.S_ISDIR(info.st_mode) if want_dir else stat.S_ISREG(info.st_mode)
    problem = ("is a symlink" if stat.S_ISLNK(info.st_mode)
               else f"is not a {'directory' if want_dir else 'regular file'}" if not kind_ok
               else f"is owned by uid {info.st_uid}, not this user ({os.geteuid()})"
               if info.st_uid != os.geteuid()
               else f"has mode {stat.S_IMODE(info.st_mode):o} (group or others have access)"
               if info.st_mode & 0o077 else None)
    if problem:
        raise PrivateDirError(f"refusing {path}: it {problem}; remove it or set PD_PRIVATE_DIR "
                              "to a directory only this user can access")
    return info
