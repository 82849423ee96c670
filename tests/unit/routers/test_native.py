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

import pytest

from pd_plugins.routers import native

EXT = sysconfig.get_config_var("EXT_SUFFIX")

# Run in a fresh interpreter: activate() must come before anything imports the hot modules, and
# this test process has them imported (interpreted) already.
LOAD = ("from pd_plugins.routers import native; print(native.activate()); "
        "import pd_plugins.routers.proxy, pd_plugins.routers.http_client as m; print(m.__file__)")


def copy_sources(to):
    for module in native.HOT_MODULES:
        target = to.joinpath(*module.split(".")).with_suffix(".py")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(native.source_path(module), target)


def test_a_build_is_of_exactly_its_sources(tmp_path):
    copy_sources(tmp_path)
    assert native.digest(tmp_path) == native.digest()
    edited = tmp_path / "pd_plugins" / "routers" / "exchange.py"
    edited.write_text(edited.read_text() + "\n# an edit\n")
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
    if os.environ.get(native.SWITCH) == "0":
        pytest.skip(f"{native.SWITCH}=0: no native build wanted")
    if not (native.build_dir() / "manifest.json").is_file():
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
    assert loaded == str(native.build_dir() / "pd_plugins" / "routers" / f"http_client{EXT}")
    said, loaded = run({native.SWITCH: "0"})
    assert said.startswith("interpreted") and loaded == str(native.source_path(
        "pd_plugins.routers.http_client"))


@pytest.mark.processes
def test_a_damaged_build_is_refused(tmp_path):
    built_or_skip()
    copy = tmp_path / native.build_dir().name
    shutil.copytree(native.build_dir(), copy)
    (copy / f"{native.GROUP}__mypyc{EXT}").write_bytes(b"not a shared library")
    said, loaded = run({native.DIR: str(tmp_path)})
    assert said.startswith(f"interpreted: the native build in {copy} does not load")
    assert loaded.endswith("http_client.py")
