"""The router's hot path compiled to C with mypyc, loaded where a build of its exact sources exists.

What pd-router does per request is Python: reading the client's request, the legs' HTTP, the
exchange between them, the books. Interpreted, about 40% of its instructions are the bytecode
loop itself (docs/benchmarks.md). mypyc (mypy's compiler) turns the type-annotated modules in
HOT_MODULES into C extension modules: attribute reads become struct reads, calls between them
direct C calls. They stay ordinary Python source; the annotations are checked at run time.

    python -m pd_plugins.routers.native            # build (make bootstrap does), if not built
    python -m pd_plugins.routers.native --status   # what pd-router would load, and why

A build lives in a directory named by a digest of the package's sources, how they are compiled
and the interpreter (`<sys.prefix>/share/pd-router-native/<digest>`, or under
$PD_ROUTER_NATIVE_DIR, a directory for builds only). pd-router (cli.main) calls activate()
before anything imports those modules: it loads them from that directory if it exists. A
package edited since has another digest, so a stale build is never loaded; the router then runs
the interpreted modules, as it does with PD_ROUTER_NATIVE=0.
Everything else, and every process that imports the modules without cli.main (the tests' own
process, bench tools), runs them interpreted.

What the compiled modules give up (docs/router.md, "Native hot path"): their classes cannot
be patched at run time nor subclassed from interpreted code (where allowed, `mypyc_attr` says
so), no async generators, and a value of a type its annotation does not admit raises TypeError
where it is passed, not later.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Mapping

HOT_MODULES = tuple(f"pd_plugins.routers.{name}" for name in (
    "http_client", "http_server", "request", "exchange", "proxy", "accounting", "upstream",
    "deadline", "failover", "workers", "stream_relay", "flows.base", "flows.vllm", "flows.sglang",
    # the policy's modules with no msgspec Struct class (mypyc rewrites a class's annotations)
    "policy.scheduler", "policy.latency_model", "policy.adapters", "policy.load", "policy.prefix",
    "policy.prefix_index"))
SWITCH = "PD_ROUTER_NATIVE"  # "0": run the interpreted modules
DIR = "PD_ROUTER_NATIVE_DIR"  # where builds live
GROUP = "pd_router_native"
GROUP_LIB = GROUP + "__mypyc"  # mypyc's shared library of the group: all the compiled code
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding pd_plugins/
# mypy's checks the build runs, beyond its defaults: the imports it cannot see are Any, and an
# attribute of an X | None read where the flow's order has set it (a Leg's connection once sent)
# is not proven statically; at run time such a read of None raises, as interpreted.
MYPY_FLAGS = ("--ignore-missing-imports", "--follow-imports=silent",
              "--disable-error-code=union-attr")


OPT_LEVEL = "3"
BUILD_NAME = re.compile(r"[0-9a-f]{20}")  # a build's directory: its digest (pruning removes no other)

# What activate() found; metrics.py exports it (pd_router_native_hot_path).
status = "interpreted: activate() was not called"


def source_path(module: str) -> Path:
    return PACKAGE_ROOT.joinpath(*module.split(".")).with_suffix(".py")


def digest(root: Path = PACKAGE_ROOT) -> str:
    """What a build is of: every module of the package under `root` (the compiled code checks
    the types of what it reads from the others, as they were when it was built), how it is
    compiled, and the interpreter it loads into."""
    h = hashlib.sha256()
    h.update(f"{sys.version}\0{sysconfig.get_config_var('EXT_SUFFIX')}\0{OPT_LEVEL}\0"
             f"{MYPY_FLAGS}\0{HOT_MODULES}\0".encode())
    package = root / "pd_plugins"
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


def builds_dir() -> Path:
    """Builds only: a build removes every other build it finds here (BUILD_NAME, a manifest)."""
    return Path(os.environ.get(DIR) or Path(sys.prefix) / "share" / "pd-router-native")


def build_dir() -> Path:
    """Where the build of the current sources is (or would be)."""
    return builds_dir() / digest()


def built(where: Path) -> bool:
    """A whole build is there (its manifest is written last)."""
    return (where / "manifest.json").is_file()


def switched_off(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(SWITCH, "1") == "0"


def _file(where: Path, name: str) -> Path:
    """A module's extension file in a build (the group's shared library is top-level)."""
    return where.joinpath(*name.split(".")).with_name(
        name.rpartition(".")[2] + sysconfig.get_config_var("EXT_SUFFIX"))


class _Finder(importlib.abc.MetaPathFinder):
    """Finds HOT_MODULES and the group's shared library in one build directory, nothing else."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.names = {*HOT_MODULES, GROUP_LIB}

    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        file = _file(self.where, name)
        loader = importlib.machinery.ExtensionFileLoader(name, str(file))
        return importlib.util.spec_from_file_location(name, file, loader=loader)


def activate() -> str:
    """Load HOT_MODULES from this sources' build from now on, if there is one, and import them;
    say which runs (also kept in `status`)."""
    global status
    status = _activate()
    return status


def _activate() -> str:
    if switched_off():
        return f"interpreted ({SWITCH}=0)"
    try:
        where = build_dir()
    except OSError as exc:  # a source that cannot be read: no build can be known to match
        return f"interpreted: the sources could not be read ({exc})"
    if not built(where):
        return (f"interpreted: no native build of these sources in {where.parent} "
                f"(python -m pd_plugins.routers.native builds one)")
    first = next((m for m in HOT_MODULES if m in sys.modules), None)
    if first is not None:
        return f"interpreted: {first} was imported before activate()"
    missing = [m for m in (GROUP_LIB, *HOT_MODULES) if not _file(where, m).is_file()]
    if missing:
        return f"interpreted: the native build in {where} lacks {missing[0]}"
    finder = _Finder(where)
    sys.meta_path.insert(0, finder)
    before = set(sys.modules)
    try:  # every module now: a build that does not load (a damaged file) is known here
        for module in (GROUP_LIB, *HOT_MODULES):
            importlib.import_module(module)
    except Exception as exc:  # the interpreted modules then, and why
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - before:  # ours that came in with them: imported again
            if name.startswith("pd_plugins.") or name == GROUP_LIB:
                del sys.modules[name]
        return f"interpreted: the native build in {where} does not load ({exc})"
    return f"native (mypyc build {where.name})"


def native() -> bool:
    """Whether activate() loaded the build (metrics.py)."""
    return status.startswith("native")


def build(force: bool = False) -> Path:
    """Compile HOT_MODULES into build_dir() (unless there already); the other builds there are
    removed. One build at a time (a lock in builds_dir()); a router loading an older build
    keeps the files it has open."""
    try:
        from mypyc.build import mypycify
        from setuptools import setup
        import mypy.version
    except ImportError as exc:
        raise BuildFailed(f"{exc.name} is not installed (pip install 'mypy[mypyc]', or make "
                          "bootstrap)") from None
    try:
        builds_dir().mkdir(parents=True, exist_ok=True)
        lock = open(builds_dir() / ".lock", "w")
    except OSError as exc:
        raise BuildFailed(f"cannot write to {builds_dir()} ({exc}): set {DIR} to a directory "
                          "for builds only") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released with the file)
        where = build_dir()
        if built(where) and not force:
            return where  # built meanwhile, by another
        began = time.monotonic()
        with tempfile.TemporaryDirectory(dir=builds_dir(), prefix=".building-") as tmp:
            work, out = Path(tmp, "src"), Path(tmp, "out")
            work.mkdir()
            # Only the package, linked: setuptools must not read a project's pyproject.toml here.
            os.symlink(PACKAGE_ROOT / "pd_plugins", work / "pd_plugins")
            cwd = os.getcwd()
            os.chdir(work)
            try:
                paths = [str(source_path(m).relative_to(PACKAGE_ROOT)) for m in HOT_MODULES]
                try:
                    extensions = mypycify([*MYPY_FLAGS, *paths], opt_level=OPT_LEVEL,
                                          group_name=GROUP, target_dir=str(Path(tmp, "c")))
                except SystemExit:  # mypy's errors, printed above
                    raise BuildFailed("mypy found errors in the modules to compile (above): "
                                      "mypyc compiles only code that type-checks") from None
                try:
                    setup(name=GROUP, ext_modules=extensions, script_args=[
                        "--quiet", "build_ext", "--build-lib", str(out), "--build-temp",
                        str(Path(tmp, "temp")), "--parallel", str(os.cpu_count() or 1)])
                except (Exception, SystemExit) as exc:
                    raise BuildFailed(
                        f"the C compiler failed ({exc}; more above). It needs gcc and Python's "
                        "headers (Debian/Ubuntu: apt-get install gcc python3-dev)") from None
            finally:
                os.chdir(cwd)
            (out / "manifest.json").write_text(json.dumps({
                "modules": list(HOT_MODULES), "mypy": mypy.version.__version__,
                "python": sys.version, "built_s": round(time.monotonic() - began, 1)}, indent=1))
            if where.exists():  # (--force) aside first: never half a build under its name
                where.rename(Path(tmp, "old"))
            out.rename(where)
        prune(keep=where)
    return where


def prune(keep: Path) -> None:
    """Remove the builds in keep's directory but `keep` (a build: a digest's name, a manifest)."""
    for old in keep.parent.iterdir():
        if old != keep and BUILD_NAME.fullmatch(old.name) and built(old):
            shutil.rmtree(old, ignore_errors=True)


class BuildFailed(Exception):
    """Why a build failed, for the person running it."""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pd_plugins.routers.native",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--status", action="store_true", help="say what pd-router would load, and why")
    p.add_argument("--force", action="store_true", help="build again even if built")
    p.add_argument("--quiet", action="store_true", help="say nothing if already built")
    args = p.parse_args(argv)
    if args.status:
        print(f"pd-router hot path: {activate()}")
        return
    if switched_off():
        print(f"pd-router native build: skipped ({SWITCH}=0: the router runs interpreted)")
        return
    where = build_dir()
    if built(where) and not args.force:
        if not args.quiet:
            print(f"pd-router native build: up to date ({where})")
        return
    print("pd-router native build: compiling the router's hot path with mypyc (about 40 s)",
          flush=True)
    try:
        where = build(force=args.force)
    except BuildFailed as exc:
        raise SystemExit(f"pd-router native build failed: {exc}. {SWITCH}=0 skips the build: the "
                         "router then runs interpreted, slower.") from None
    print(f"pd-router native build: done in "
          f"{json.loads((where / 'manifest.json').read_text())['built_s']} s ({where})")


if __name__ == "__main__":
    main()
