"""The package's layering, read from the source (every import, including ones inside functions).

- pd_plugins.vocab is a leaf: it imports nothing else from pd_plugins.
- Engine code (connectors, transfer, patches) never imports the router: a vLLM worker must not load
  router code (or its ZMQ/aiohttp dependencies) through a shared helper.
- The mock engine and the performance tools do not import each other.
- No import cycle anywhere in pd_plugins.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "pd_plugins"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """pd_plugins modules `name` imports (a `from pkg import sub` counts as importing pkg.sub)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) - {name} for name, path in modules.items()}


def _offenders(graph, importer_prefixes, imported_prefix):
    return sorted(f"{m} imports {dep}" for m, deps in graph.items()
                  if m.startswith(importer_prefixes) for dep in deps if dep.startswith(imported_prefix))


def test_vocab_is_a_leaf(graph):
    assert graph["pd_plugins.vocab"] == set()
    assert [f"{m} imports {d}" for m, deps in graph.items() if m.startswith("pd_plugins.vocab")
            for d in deps if not d.startswith("pd_plugins.vocab")] == []


def test_engine_code_never_imports_the_router(graph):
    engine = ("pd_plugins.connectors", "pd_plugins.transfer", "pd_plugins.patches",
              "pd_plugins.vllm_plugin", "pd_plugins.sglang_plugin")
    assert _offenders(graph, engine, "pd_plugins.routers") == []


def test_mock_and_perf_do_not_import_each_other(graph):
    """The mock may time its answers with perf's engine model, but then perf's tools (the replay)
    must reach the mock only over HTTP, not by importing it."""
    mock_to_perf = _offenders(graph, ("pd_plugins.mock",), "pd_plugins.perf")
    perf_to_mock = _offenders(graph, ("pd_plugins.perf",), "pd_plugins.mock")
    assert not (mock_to_perf and perf_to_mock), (mock_to_perf, perf_to_mock)


def test_no_import_cycle(graph):
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


def test_the_checker_sees_imports_inside_functions():
    """A lazy import is still an import (a cycle or a layering breach hidden in a function)."""
    modules = _modules()
    deps = _imports("pd_plugins.routers.config", modules["pd_plugins.routers.config"], set(modules))
    assert "pd_plugins.routers.kv_sources.events" in deps  # imported in WorkerSpec.__post_init__
