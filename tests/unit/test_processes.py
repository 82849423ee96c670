"""pd_plugins/testing/processes.py: what a test learns about a server that hangs, and where servers log."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pd_plugins.testing.processes import LOG_ROOT_VAR, ManagedProcess

pytestmark = pytest.mark.processes  # starts a process group and py-spy (tests/tiers.py)


@dataclass
class Sleeper(ManagedProcess):
    """A process group of two: a Python parent sleeping in a named function, and a child."""

    name: str = "sleeper"

    def command(self) -> list[str]:
        script = ("import subprocess, sys, time\n"
                  "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                  "def waiting_for_godot():\n"
                  "    time.sleep(60)\n"
                  "waiting_for_godot()\n")
        return [sys.executable, "-c", script]


def test_stack_dump_shows_every_process_of_the_group_and_where_it_waits():
    server = Sleeper()
    with server:
        deadline = time.monotonic() + 20
        asleep = lambda ps: len(ps) == 2 and all(p.startswith("S, ") for p in ps.values())  # noqa: E731
        while not asleep(server.group_processes()) and time.monotonic() < deadline:
            time.sleep(0.1)  # both start running (R) and then sleep; a busy machine takes longer
        processes = server.group_processes()
        assert len(processes) == 2 and all(p.startswith("S, ") for p in processes.values())
        dump = server.stack_dump()
    assert dump.count("--- pid ") == 2
    assert "waiting_for_godot" in dump  # py-spy is a test dependency: stacks, not just states
    assert server.group_processes() == {}  # stopped: the whole group is gone


def test_test_servers_log_under_pytests_own_temporary_directory(tmp_path_factory, monkeypatch):
    """tests/conftest.py points LOG_ROOT_VAR at pytest's basetemp (pruned to the last three runs);
    without it a server's log directory is a new one in the system's temporary directory."""
    log_dir = Sleeper().log_dir  # a dataclass made, nothing started
    assert log_dir.is_dir() and log_dir.parent == Path(os.environ[LOG_ROOT_VAR])
    assert log_dir.is_relative_to(tmp_path_factory.getbasetemp())
    monkeypatch.delenv(LOG_ROOT_VAR)
    elsewhere = Sleeper().log_dir
    try:
        assert elsewhere.parent == Path(tempfile.gettempdir())
    finally:
        elsewhere.rmdir()


def test_a_parent_stopped_by_sigterm_or_sighup_stops_the_servers_it_started(tmp_path):
    # servers run in sessions of their own: a terminal's hangup never reaches them, and Python's
    # default SIGTERM runs no `finally`; `make demo` left its three servers running so
    import signal
    import subprocess

    for signum in (signal.SIGTERM, signal.SIGHUP):
        pid_file = tmp_path / f"child-{signum}"
        script = (
            "import sys, time\n"
            "from dataclasses import dataclass\n"
            "from pd_plugins.testing.processes import ManagedProcess, stop_servers_on_signals\n"
            "@dataclass\n"
            "class Server(ManagedProcess):\n"
            "    name: str = 'server'\n"
            "    def command(self):\n"
            "        return [sys.executable, '-c', 'import time; time.sleep(60)']\n"
            "server = Server()\n"
            "stop_servers_on_signals()\n"
            "try:\n"
            "    server.start()\n"
            f"    open({str(pid_file)!r}, 'w').write(str(server.proc.pid))\n"
            "    time.sleep(60)\n"
            "finally:\n"
            "    server.stop()\n")
        parent = subprocess.Popen([sys.executable, "-c", script])
        try:
            deadline = time.monotonic() + 30
            while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
                time.sleep(0.05)
            child = int(pid_file.read_text())
            parent.send_signal(signum)
            parent.wait(timeout=30)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.kill(child, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
            else:
                os.kill(child, signal.SIGKILL)
                pytest.fail(f"the server outlived its parent after signal {signum}")
        finally:
            parent.kill()


@dataclass
class SocketLeaver(ManagedProcess):
    """Binds a Unix socket in its scratch directory and is killed with it open, as a vLLM engine
    core leaves its IPC sockets behind."""

    name: str = "socket-leaver"

    def environment(self) -> dict[str, str]:
        return {**os.environ, "SCRATCH": str(self.scratch_dir())}

    def command(self) -> list[str]:
        script = ("import os, socket, time\n"
                  "s = socket.socket(socket.AF_UNIX)\n"
                  "s.bind(os.path.join(os.environ['SCRATCH'], 'engine.sock'))\n"
                  "time.sleep(60)\n")
        return [sys.executable, "-c", script]


def test_what_a_killed_server_leaves_in_its_scratch_directory_goes_with_it():
    server = SocketLeaver().start()
    try:
        scratch = server._scratch[0]
        deadline = time.monotonic() + 20
        while not (scratch / "engine.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (scratch / "engine.sock").is_socket()
        assert len(str(scratch / "0123456789abcdef0123456789abcdef0123")) < 108  # a socket path
    finally:
        server.stop(grace=0.5)  # SIGTERM ends it at once; SIGKILL would leave the same
    assert not scratch.exists()


def test_a_vllm_servers_rendezvous_file_and_sockets_go_in_its_scratch_directory(tmp_path):
    """vLLM names its torch rendezvous file in the temporary directory (vllm_dist_*) and its
    engine core's IPC sockets under VLLM_RPC_BASE_PATH; a killed server left the files in /tmp.
    vLLM's own functions, in a process with the server's environment, name paths in its scratch
    directory, which stop() removes; torch's compile cache and pd-plugins' private directory
    stay where they are for every process on the host."""
    pytest.importorskip("vllm")
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from pd_plugins.testing.engine_harness import VllmServer
    from pd_plugins.transfer.private_dir import private_dir

    server = VllmServer("vllm-env", model=tmp_path, cpu="0", log_dir=tmp_path)
    env = server.environment()
    scratch = server._scratch[0]
    script = ("from vllm.utils.network_utils import get_file_store_init_method\n"
              "import vllm.envs as envs\n"
              "import torch._inductor.runtime.cache_dir_utils as inductor\n"
              "from pd_plugins.transfer.private_dir import private_dir\n"
              "print(get_file_store_init_method()); print(envs.VLLM_RPC_BASE_PATH)\n"
              "print(inductor.cache_dir()); print(private_dir())\n")
    try:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=120, check=True).stdout.split()
    finally:
        shutil.rmtree(scratch)
    assert out[0].startswith(f"file://{scratch}/vllm_dist_")
    assert out[1] == str(scratch)
    # what is the host's stays where it was: torch's compile cache (hundreds of MB, built
    # once), pd-plugins' private directory (the per-host peer secret, shared by every engine)
    assert out[2] == default_cache_dir() and out[3] == private_dir()
