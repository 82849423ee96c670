"""pd_plugins/testing/processes.py: what a test learns about a server that hangs."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import pytest

from pd_plugins.testing.processes import ManagedProcess

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
