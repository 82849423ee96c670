"""pd_plugins/testing/processes.py: what a test learns about a server that hangs, and where servers log."""

from __future__ import annotations

import os
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
