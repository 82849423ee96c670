"""tests/tiers.py: what keeps `make test-fast` free of processes."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from tests.tiers import PROCESS_DIRS, TESTS, StartsAProcess, in_process_dir, no_processes


def test_every_way_to_start_a_process_is_refused_and_put_back_afterwards():
    before = (subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start, os.fork,
              os.system)
    with no_processes("this test") as attempts:
        with pytest.raises(StartsAProcess, match="this test starts a process"):
            subprocess.run([sys.executable, "-c", "pass"])
        with pytest.raises(StartsAProcess):
            multiprocessing.get_context("spawn").Process(target=print).start()
        assert os.fork is not before[2]  # else the call below would fork this pytest
        with pytest.raises(StartsAProcess):
            os.fork()
        with pytest.raises(StartsAProcess):
            os.system("true")
    assert attempts == ["subprocess", "multiprocessing", "os.fork", "os.system"]
    assert before == (subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start,
                      os.fork, os.system)


def test_a_process_a_module_starts_while_it_is_imported_is_let_through(tmp_path, monkeypatch):
    # as vLLM's first import does (platform.architecture runs `file`): the library's doing
    (tmp_path / "probes_the_machine.py").write_text(
        "import subprocess\nANSWER = subprocess.run(['true']).returncode\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with no_processes("this test") as attempts:
        import probes_the_machine
    assert probes_the_machine.ANSWER == 0 and attempts == []


def test_whole_directories_are_in_the_processes_tier():
    assert {"router", "e2e"} <= PROCESS_DIRS
    assert in_process_dir(TESTS / "router" / "test_flows.py")
    assert in_process_dir(TESTS / "e2e" / "test_pd_nixl.py")
    assert not in_process_dir(TESTS / "unit" / "test_tiers.py")
    assert not in_process_dir(TESTS.parent / "bench" / "common.py")


FAST_TESTS = """
import subprocess, sys
import pytest

def test_swallows_the_refusal():
    try:
        subprocess.run([sys.executable, "-c", "pass"])
    except Exception:
        pass

@pytest.mark.processes
def test_marked():
    pass

def test_pure():
    assert 1 + 1 == 2
"""


def test_a_fast_test_that_starts_a_process_fails_even_if_it_catches_the_refusal(pytester):
    pytester.makepyfile(test_tier=FAST_TESTS)
    result = pytester.runpytest_inprocess("-p", "tests.tiers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_swallows_the_refusal tried to start a process (subprocess)*"])
    deselected = pytester.runpytest_inprocess("-p", "tests.tiers", "-p", "no:cacheprovider",
                                              "-m", "not processes")
    deselected.assert_outcomes(passed=1, failed=1, deselected=1)
