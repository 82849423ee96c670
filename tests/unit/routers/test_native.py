"""The router's compiled hot path (pd_plugins/routers/native.py): which build is loaded, when.

The router processes of tests/router and tests/e2e run it compiled (make test builds it first);
this file checks what decides that: a build is found only for the exact sources it was made from,
a damaged one is refused, and PD_ROUTER_NATIVE=0 turns it off."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from pd_plugins.routers import native

EXT = sysconfig.get_config_var("EXT_SUFFIX")

# Run in a fresh interpreter: activate() must come before anything imports the hot modules, and
# this test process has them imported (interpreted) already.
LOAD = ("import importlib; from pd_plugins.routers import native; print(native.activate()); "
        "print(*(importlib.import_module(m).__file__ for m in native.HOT_MODULES))")


def copy_sources(to):
    """The package's Python files (all a digest reads) under `to`."""
    shutil.copytree(native.PACKAGE_ROOT / "pd_plugins", to / "pd_plugins",
                    ignore=lambda folder, names: [n for n in names if not n.endswith(".py")
                                                  and not (Path(folder) / n).is_dir()])


@pytest.mark.parametrize("edited", ["routers/exchange.py",  # compiled
                                    "routers/policy/base.py"])  # read by compiled code
def test_a_build_is_of_exactly_its_sources(tmp_path, edited):
    copy_sources(tmp_path)
    assert native.digest(tmp_path) == native.digest()
    path = tmp_path / "pd_plugins" / edited
    path.write_text(path.read_text() + "\n# an edit\n")
    assert native.digest(tmp_path) != native.digest()  # so its build is not the edited code's


def test_without_a_build_the_router_runs_interpreted(tmp_path, monkeypatch):
    monkeypatch.setenv(native.DIR, str(tmp_path))
    finders = list(sys.meta_path)
    said = native.activate()
    assert said.startswith("interpreted: no native build") and "pd_plugins.routers.native" in said
    assert sys.meta_path == finders


def test_switched_off(monkeypatch):
    monkeypatch.setenv(native.SWITCH, "0")
    finders = list(sys.meta_path)
    assert native.activate() == f"interpreted ({native.SWITCH}=0)"
    assert sys.meta_path == finders


def built_or_skip():
    if native.switched_off():
        pytest.skip(f"{native.SWITCH}=0: no native build wanted")
    if not native.built(native.build_dir()):
        pytest.fail(f"no native build of these sources in {native.builds_dir()}: make bootstrap "
                    "builds it (python -m pd_plugins.routers.native)")


def run(env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", LOAD], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.splitlines()


@pytest.mark.processes
def test_the_router_loads_the_build_of_its_sources():
    built_or_skip()
    said, loaded = run({})
    assert said == f"native (mypyc build {native.build_dir().name})"
    assert loaded.split() == [str(native.build_dir().joinpath(*m.split(".")).with_name(
        m.rpartition(".")[2] + EXT)) for m in native.HOT_MODULES]
    said, loaded = run({native.SWITCH: "0"})
    assert said == f"interpreted ({native.SWITCH}=0)"
    assert loaded.split() == [str(native.source_path(m)) for m in native.HOT_MODULES]


@pytest.mark.processes
def test_pd_router_imports_none_of_them_before_it_loads_the_build():
    # what cli imports at its top: a hot module among it would run interpreted (activate says so)
    out = subprocess.run([sys.executable, "-c", "import sys, pd_plugins.routers.cli as c; "
                          "print(*[m for m in c.native.HOT_MODULES if m in sys.modules])"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == []


@pytest.mark.processes
@pytest.mark.parametrize("damage", ["garbled", "missing"])
def test_a_damaged_build_is_refused(tmp_path, damage):
    built_or_skip()
    copy = tmp_path / native.build_dir().name
    shutil.copytree(native.build_dir(), copy)
    if damage == "garbled":  # the group's library: all the compiled code is in it
        native._file(copy, native.GROUP_LIB).write_bytes(b"not a shared library")
    else:  # a module's own file (a stub that calls into the group's library)
        native._file(copy, "pd_plugins.routers.workers").unlink()
    said, loaded = run({native.DIR: str(tmp_path)})
    assert said.startswith(f"interpreted: the native build in {copy} "
                           + ("does not load" if damage == "garbled" else "lacks"))
    assert loaded.split() == [str(native.source_path(m)) for m in native.HOT_MODULES]


def test_a_build_removes_only_older_builds(tmp_path):
    """What a build prunes, in a directory that also holds what is not a build of ours."""
    current, older = tmp_path / native.digest(), tmp_path / ("0" * 20)
    unrelated, unfinished = tmp_path / "notes", tmp_path / ("1" * 20)
    for folder in (current, older, unrelated, unfinished):
        folder.mkdir()
    for built in (current, older, unrelated):
        (built / "manifest.json").write_text("{}")
    native.prune(keep=current)
    assert not older.exists()
    assert current.exists() and unrelated.exists() and unfinished.exists()
