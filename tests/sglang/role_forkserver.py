"""Start tests/sglang's role processes by forking one interpreter that has SGLang imported.

Importing SGLang costs about 11 s of CPU per process on the CI host, and tests/sglang starts a
few dozen role processes. The server runs in .venv-sglang, imports `tests.sglang.sglang_roles`
once, and forks one child per request: the child takes the caller's environment, arguments and
pipes (stdout, stderr, passed as file descriptors), gets a process group of its own, and runs the
role as `python -m tests.sglang.sglang_roles ...` would. Each role is still its own process;
nothing of SGLang's or ours has been set up in the server but the imports (no plugin loaded, no
manager, no NIXL agent).

The client side (`RoleForkServer`, `ForkedRole`) runs in the tests' own interpreter and imports
nothing of SGLang.

    python -m tests.sglang.role_forkserver <unix socket path>
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

MAX_REQUEST_BYTES = 1 << 20  # one request: arguments and environment, as JSON


# --------------------------------------------------------------------- server (in .venv-sglang)

def serve(path: str) -> None:
    import tests.sglang.sglang_roles as roles  # the expensive part, once

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()
    print("ready", flush=True)
    while True:
        # stdin is a pipe from the tests: its end (they exited, even by SIGKILL) ends the server
        readable, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            with contextlib.suppress(OSError):  # nobody is left to remove it
                os.unlink(path)
                os.rmdir(os.path.dirname(path))
            return
        if listener in readable:
            conn, _ = listener.accept()
            with conn:
                _fork_one(roles, listener, conn)


def _fork_one(roles, listener: socket.socket, conn: socket.socket) -> None:
    message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 2)
    if not message or len(fds) != 2:  # a client that closed without asking
        for fd in fds:
            os.close(fd)
        return
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        _run_role(roles, message, fds)  # never returns
    with contextlib.suppress(OSError):  # also here: no window where killpg misses it
        os.setpgid(pid, pid)
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(str(pid).encode())
    except OSError:  # the client gave up waiting: nobody would ever stop this role
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _run_role(roles, message: bytes, fds: list[int]) -> None:
    code = 1
    try:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
            os.dup2(fd, target)
            os.close(fd)
        request = json.loads(message)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        roles.main(request["argv"])
        code = 0
    except SystemExit as exc:  # as the interpreter exits: an int is the code, else printed
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a role's failure is the test's to read on stderr
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# --------------------------------------------------------------------- client (in the tests)

class ForkedRole:
    """A role process forked by the server: its pid (also its process group), its pipes, and the
    JSON events it prints one per line."""

    def __init__(self, name: str, pid: int, stdout, stderr) -> None:
        self.name, self.pid, self.stdout, self.stderr = name, pid, stdout, stderr
        self.killed = False

    def next_event(self, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.stdout.readline()
            if line.startswith("{"):
                return json.loads(line)
            if not line:  # end of its stdout: it exited
                break
        self.kill()
        stderr = self.stderr.read()[-3000:]
        self.stop()
        raise AssertionError(f"no event from {self.name}; stderr:\n{stderr}")

    def stop(self) -> None:
        self.kill()
        self.stdout.close()
        self.stderr.close()

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self, timeout_s: float = 10) -> None:
        """SIGKILL to its process group, and wait until the kernel has reaped it (once: its pid
        may be another process's afterwards)."""
        if self.killed:
            return
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while self.alive():
            assert time.monotonic() < deadline, f"{self.name} (pid {self.pid}) outlived SIGKILL"
            time.sleep(0.01)


class RoleForkServer:
    """The server process, started with `python` (.venv-sglang's) in `cwd`."""

    def __init__(self, python: Path, cwd: Path, env: dict[str, str]) -> None:
        self.cwd = cwd
        self._dir = tempfile.mkdtemp(prefix="pd-sglang-forkserver-")  # 0700: this user only
        self.path = os.path.join(self._dir, "socket")
        # its stdin is a pipe held by this process alone: when this process ends, so does it
        self.proc = subprocess.Popen([str(python), "-m", "tests.sglang.role_forkserver", self.path],
                                     cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.proc.stdout.readline()  # after SGLang's imports
        if line.strip() != "ready":
            self.close()
            raise RuntimeError(f"the role fork server did not start (said {line!r})")

    def start(self, env: dict[str, str], role: str, spec: dict | None = None) -> ForkedRole:
        """Fork `role` (sglang_roles.py's argument) with `spec` (its JSON argument) in `env`."""
        argv = [role] if spec is None else [role, json.dumps(spec)]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
                conn.settimeout(30)
                conn.connect(self.path)
                request = {"argv": argv, "env": env, "cwd": str(self.cwd)}
                socket.send_fds(conn, [json.dumps(request).encode()], [out_w, err_w])
                reply = conn.recv(64)
            if not reply:
                raise RuntimeError(f"the role fork server did not start {argv[0]} (it exited: "
                                   f"{self.proc.poll()})")
            pid = int(reply)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return ForkedRole(argv[0], pid, open(out_r, encoding="utf-8", errors="replace"),
                          open(err_r, encoding="utf-8", errors="replace"))

    def close(self) -> None:
        self.proc.stdin.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1])
