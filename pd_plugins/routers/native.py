"""The router's hot path compiled to C with mypyc, loaded where a build of its exact sources exists.

What pd-router does per request is Python: reading the client's request, the legs' HTTP, the
exchange between them, the books. Interpreted, about 40% of its instructions are the bytecode
loop itself (docs/benchmarks.md). mypyc (mypy's compiler) turns the type-annotated modules in
HOT_MODULES into C extension modules: attribute reads become struct reads, calls between them
direct C calls. They stay ordinary Python source; the annotations are checked at run time.

    python -m pd_plugins.routers.native            # build (make bootstrap does), if not built
    python -m pd_plugins.routers.native --status   # what pd-router would load, and why

A build lives in a directory named by a digest of HOT_MODULES' sources and the interpreter
(`<sys.prefix>/share/pd-router-native/<digest>`, or under $PD_ROUTER_NATIVE_DIR). pd-router
(cli.main) calls activate() before anything imports those modules: it loads them from that
directory if it exists. A source edited since has another digest, so a stale build is never
loaded; the router then runs the interpreted modules, as it does with PD_ROUTER_NATIVE=0.
Everything else, and every process that imports the modules without cli.main (the tests' own
process, bench tools), runs them interpreted.

What the compiled modules give up (docs/router.md, "Native hot path"): their classes cannot
be patched at run time nor subclassed from interpreted code (where allowed, `mypyc_attr` says
so), no async generators, and a value of a type its annotation does not admit raises TypeError
where it is passed, not later.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HOT_MODULES = tuple(f"pd_plugins.routers.{name}" for name in (
    "http_client", "http_server", "request", "exchange", "proxy", "accounting", "upstream",
    "deadline", "failover", "workers", "flows.base", "flows.vllm", "flows.sglang",
    # the policy's modules with no msgspec Struct class (mypyc rewrites a class's annotations)
    "policy.scheduler", "policy.latency_model", "policy.adapters", "policy.load", "policy.prefix",
    "policy.prefix_index"))
SWITCH = "PD_ROUTER_NATIVE"  # "0": run the interpreted modules
DIR = "PD_ROUTER_NATIVE_DIR"  # where builds live
GROUP = "pd_router_native"  # mypyc's shared library of the group: <GROUP>__mypyc
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding pd_plugins/
# mypy's checks the build runs, beyond its defaults: the imports it cannot see are Any, and an
# attribute of an X | None read where the flow's order has set it (a Leg's connection once sent)
# is not proven statically; at run time such a read of None raises, as interpreted.
MYPY_FLAGS = ("--ignore-missing-imports", "--follow-imports=silent",
              "--disable-error-code=union-attr")


def source_path(module: str) -> Path:
    return PACKAGE_ROOT.joinpath(*module.split(".")).with_suffix(".py")


def digest(root: Path = PACKAGE_ROOT) -> str:
    """What a build is of: HOT_MODULES' sources under `root`, and the interpreter it loads into."""
    h = hashlib.sha256()
    h.update(f"{sys.version}\0{sysconfig.get_config_var('EXT_SUFFIX')}\0".encode())
    for module in HOT_MODULES:
        h.update(module.encode() + b"\0")
        h.update(root.joinpath(*module.split(".")).with_suffix(".py").read_bytes())
    return h.hexdigest()[:20]


def builds_dir() -> Path:
    return Path(os.environ.get(DIR) or Path(sys.prefix) / "share" / "pd-router-native")


def build_dir() -> Path:
    """Where the build of the current sources is (or would be)."""
    return builds_dir() / digest()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds HOT_MODULES and the group's shared library in one build directory, nothing else."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.names = {*HOT_MODULES, GROUP + "__mypyc"}

    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        file = self.where.joinpath(*name.split(".")).with_name(
            name.rpartition(".")[2] + sysconfig.get_config_var("EXT_SUFFIX"))
        loader = importlib.machinery.ExtensionFileLoader(name, str(file))
        return importlib.util.spec_from_file_location(name, file, loader=loader)


def activate() -> str:
    """Load HOT_MODULES from this sources' build from now on, if there is one; say which runs."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"interpreted ({SWITCH}=0)"
    where = build_dir()
    if not (where / "manifest.json").is_file():
        return (f"interpreted: no native build of these sources in {where.parent} "
                f"(python -m pd_plugins.routers.native builds one)")
    first = next((m for m in HOT_MODULES if m in sys.modules), None)
    if first is not None:
        return f"interpreted: {first} was imported before activate()"
    finder = _Finder(where)
    sys.meta_path.insert(0, finder)
    try:  # a build that does not load (a damaged file): the interpreted modules, and why
        importlib.import_module(GROUP + "__mypyc")
    except ImportError as exc:
        sys.meta_path.remove(finder)
        return f"interpreted: the native build in {where} does not load ({exc})"
    return f"native (mypyc build {where.name})"


def build(force: bool = False) -> Path:
    """Compile HOT_MODULES into build_dir() (unless there already); older builds are removed."""
    where = build_dir()
    if (where / "manifest.json").is_file() and not force:
        return where
    try:
        from mypyc.build import mypycify
        from setuptools import setup
        import mypy.version
    except ImportError as exc:
        raise SystemExit(f"pd-router native build: {exc.name} is not installed "
                         "(pip install 'mypy[mypyc]', or make bootstrap)") from None
    builds_dir().mkdir(parents=True, exist_ok=True)
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
            extensions = mypycify([*MYPY_FLAGS, *paths], opt_level="3", group_name=GROUP,
                                  target_dir=str(Path(tmp, "c")))
            setup(name=GROUP, ext_modules=extensions, script_args=[
                "--quiet", "build_ext", "--build-lib", str(out), "--build-temp",
                str(Path(tmp, "temp")), "--parallel", str(os.cpu_count() or 1)])
        finally:
            os.chdir(cwd)
        (out / "manifest.json").write_text(json.dumps({
            "modules": list(HOT_MODULES), "mypy": mypy.version.__version__,
            "python": sys.version, "built_s": round(time.monotonic() - began, 1)}, indent=1))
        shutil.rmtree(where, ignore_errors=True)
        out.rename(where)
    for old in builds_dir().iterdir():  # one build kept: the current sources'
        if old.is_dir() and old.name != where.name and not old.name.startswith(".building-"):
            shutil.rmtree(old, ignore_errors=True)
    return where


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
    if os.environ.get(SWITCH, "1") == "0":
        print(f"pd-router native build: skipped ({SWITCH}=0: the router runs interpreted)")
        return
    built = (build_dir() / "manifest.json").is_file()
    if built and not args.force:
        if not args.quiet:
            print(f"pd-router native build: up to date ({build_dir()})")
        return
    print("pd-router native build: compiling the router's hot path with mypyc (about a minute)",
          flush=True)
    try:
        where = build(force=args.force)
    except (Exception, SystemExit) as exc:  # (mypy's errors end in SystemExit, a compiler's not)
        if isinstance(exc, SystemExit) and str(exc).startswith("pd-router native build"):
            raise
        raise SystemExit(
            f"pd-router native build failed ({type(exc).__name__}: {exc}; more above). It needs a "
            "C compiler and Python's headers (Debian/Ubuntu: apt-get install gcc python3-dev). "
            f"{SWITCH}=0 skips it: the router then runs interpreted, slower.") from None
    print(f"pd-router native build: done in "
          f"{json.loads((where / 'manifest.json').read_text())['built_s']} s ({where})")


if __name__ == "__main__":
    main()
