"""The two test tiers (docs/development.md, "Tests").

- Fast (`make test-fast`): every test that starts no process, a couple of minutes for everyday work.
- `processes`: tests that start servers or other processes (pd-router and mock engines, vLLM,
  SGLang, Redis, LMCache servers, forked pool users). Whole directories are in it (PROCESS_DIRS);
  elsewhere a test or a module says so with `@pytest.mark.processes` / `pytestmark`.
  `make test` runs both tiers.

While a test outside the `processes` tier runs, starting a process fails it (`no_processes`), so
the fast tier cannot slowly fill with servers: a new test that needs one is told to take the mark.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

MARKER = "processes"
TESTS = Path(__file__).resolve().parent
# Every test in these directories starts servers: pd-router and pd-mock-engine (router), vLLM
# (e2e), SGLang in .venv-sglang (sglang), SGLang on CUDA (gpu_sglang).
PROCESS_DIRS = frozenset({"router", "e2e", "sglang", "gpu_sglang"})


class StartsAProcess(RuntimeError):
    """A test outside the `processes` tier tried to start a process."""


def in_process_dir(path: Path) -> bool:
    try:
        top = Path(path).resolve().relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return False
    return top in PROCESS_DIRS


def importing() -> bool:
    """Whether the caller runs inside an import statement (a module body being executed)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


# Where a library starts a process on its own, once per machine, and caches what it learnt: vLLM
# inspects a model class in a subprocess the first time (~/.cache/vllm/modelinfos); later runs
# read the cache. Not the test's doing, and on a fresh machine the fast tier would fail without it.
LIBRARY_PROBES = (("vllm/model_executor/models/registry.py", "_run_in_subprocess"),)


def library_probe() -> bool:
    """Whether the caller runs inside one of LIBRARY_PROBES."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if any(code.co_filename.endswith(path) and code.co_name == name
               for path, name in LIBRARY_PROBES):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def no_processes(what: str) -> Iterator[list[str]]:
    """While inside, every way Python starts a process raises StartsAProcess instead; yields the
    list of attempts (a caller may have swallowed the exception). A process started while a module
    is imported is let through: a library probing the machine (vLLM's first import runs `file`
    through platform.architecture), not the test's doing, and only where the test imports first."""
    attempts: list[str] = []

    def refuse(how: str, original):
        def refused(*args, **kwargs):
            if importing() or library_probe():
                return original(*args, **kwargs)
            attempts.append(how)
            raise StartsAProcess(f"{what} starts a process ({how}) but is not marked "
                                 f"`@pytest.mark.{MARKER}`: mark it, so that it runs in the "
                                 "processes tier and not in make test-fast (tests/tiers.py)")
        return refused

    # subprocess (and asyncio's subprocesses, os.popen) all go through Popen._execute_child;
    # multiprocessing through BaseProcess.start, whatever its start method.
    patches = [(subprocess.Popen, "_execute_child", "subprocess"),
               (multiprocessing.process.BaseProcess, "start", "multiprocessing"),
               (os, "fork", "os.fork"), (os, "forkpty", "os.forkpty"),
               (os, "posix_spawn", "os.posix_spawn"), (os, "posix_spawnp", "os.posix_spawnp"),
               (os, "system", "os.system")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches if hasattr(owner, name)]
    try:
        for owner, name, how in patches:
            if hasattr(owner, name):
                setattr(owner, name, refuse(how, getattr(owner, name)))
        yield attempts
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def pytest_configure(config: pytest.Config) -> None:
    # Declared here, with the rules that give it its meaning.
    config.addinivalue_line("markers", f"{MARKER}: starts servers or other processes (not in "
                            "make test-fast; tests/tiers.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if in_process_dir(item.path):
            item.add_marker(MARKER)


_ATTEMPTS = pytest.StashKey[list]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if item.get_closest_marker(MARKER) is not None:
        yield
        return
    with no_processes(item.nodeid) as attempts:
        item.stash[_ATTEMPTS] = attempts
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A refused start fails the phase even where the test caught the exception."""
    outcome = yield
    report = outcome.get_result()
    attempts = item.stash.get(_ATTEMPTS, None)
    if attempts:
        if report.passed:
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} tried to start a process ({', '.join(attempts)}) "
                               f"outside the `{MARKER}` tier: mark it `@pytest.mark.{MARKER}` "
                               "(tests/tiers.py)")
        attempts.clear()  # reported once, in this phase
