"""Servers started by tests, benchmarks and the demo: own port, own log, own process group.

`stop()` ends exactly the process group it started, by PID, even when a test fails; every live
server is listed in LIVE_SERVERS so a failing test can attach its log tail.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

LIVE_SERVERS: list[ManagedProcess] = []

# Where servers keep their logs: a directory of their own under this root when it is set (the
# test suite sets it to pytest's own temporary directory, which pytest prunes to the last three
# runs), else under the system's temporary directory, kept for whoever started them to read.
LOG_ROOT_VAR = "PD_TEST_LOG_ROOT"


def new_log_dir() -> Path:
    root = os.environ.get(LOG_ROOT_VAR)
    if root:
        Path(root).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="pd-test-", dir=root or None))


_HANDED_OUT: set[int] = set()
_rng = random.Random()  # seeded from the OS: concurrent test runs pick different ports


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def stop_servers_on_signals() -> None:
    """SIGTERM and SIGHUP end this process through its `finally` blocks (SystemExit), so that the
    servers it started are stopped: each runs in a session of its own (start_new_session), where
    the terminal's hangup never reaches it, and Python's default for SIGTERM runs no cleanup."""
    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, leave)


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range, never handed out twice by this process.

    A port the kernel picks for bind(0) comes from the ephemeral range, where any outgoing
    connection (an HTTP client, ZMQ, UCX) may take it between our pick and the server's bind: that
    made a router fail to start with "address already in use" on a busy CI machine."""
    floor = _ephemeral_floor()
    low = max(1024, floor - 12000)
    for _ in range(2000):
        port = _rng.randrange(low, floor)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{floor}")


@dataclass(kw_only=True)
class ManagedProcess:
    port: int = field(default_factory=free_port)
    log_dir: Path = field(default_factory=new_log_dir)
    proc: subprocess.Popen | None = None
    health_path: str = "/health"
    _scratch: list[Path] = field(default_factory=list, repr=False)  # scratch_dir()s, for stop()

    name: str  # set by subclasses as their first field

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def scratch_dir(self) -> Path:
        """A directory of the server's own, removed when it stops: for what an engine leaves in
        the temporary directory when it is killed (vLLM's IPC sockets: VLLM_RPC_BASE_PATH). Made
        in the system's temporary directory, not under the log's, so that a Unix socket's path in
        it stays within the 107 bytes Linux allows."""
        path = Path(tempfile.mkdtemp(prefix="pd-srv-"))
        self._scratch.append(path)
        return path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> ManagedProcess:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
            start_new_session=True,
        )
        log.close()
        LIVE_SERVERS.append(self)
        return self

    def wait_healthy(self, timeout: float = 240.0) -> ManagedProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}{self.health_path}", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f}s:\n{self.log_tail()}\n"
                           f"stacks:\n{self.stack_dump()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's whole process group (an engine's children included)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 15.0) -> None:
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self.kill(signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._reap_group()
        while self._scratch:
            shutil.rmtree(self._scratch.pop(), ignore_errors=True)
        if self in LIVE_SERVERS:
            LIVE_SERVERS.remove(self)

    def _reap_group(self, timeout: float = 10.0) -> None:
        """Children outliving the leader (an engine's workers): SIGKILL the group, wait until
        it is empty, so whatever they hold (ports, shared memory) is free when stop returns."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                return
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def group_processes(self) -> dict[int, str]:
        """pid -> "state, CPU seconds" for every process in the server's process group (the
        server and the engine processes it started; Linux /proc): a starved process is runnable
        (R) with little CPU, a stuck one sleeps (S, D)."""
        found = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # ended meanwhile
                continue
            if self.proc is not None and int(fields[2]) == self.proc.pid:  # pgrp: our group
                cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                found[int(stat.parent.name)] = f"{fields[0]}, {cpu:.1f} s CPU"
        return found

    def stack_dump(self) -> str:
        """Python stacks of every process in the server's group (py-spy, a test dependency): what
        a server that does not come up or does not stop is doing."""
        spy = Path(sys.executable).with_name("py-spy")
        dumps = []
        for pid, summary in sorted(self.group_processes().items()):
            if not spy.exists():
                dumps.append(f"--- pid {pid} ({summary}): no py-spy next to this Python")
                continue
            try:
                done = subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True,
                                      text=True, timeout=30)
                dumps.append(f"--- pid {pid} ({summary})\n{done.stdout}{done.stderr}")
            except (OSError, subprocess.TimeoutExpired) as exc:
                dumps.append(f"--- pid {pid} ({summary}): py-spy failed: {exc}")
        return "\n".join(dumps) or "(no processes left)"

    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
