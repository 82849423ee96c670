"""The list of pd-plugins connectors, and what each one needs to import.

Kept free of engine imports so the plugin hook can read it cheaply in every engine process.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Mapping

from pd_plugins.transfer.kv_faults import refusal


@dataclass(frozen=True)
class ConnectorSpec:
    name: str  # the value users pass as kv_connector
    module_path: str
    class_name: str
    requires: tuple[str, ...]  # top-level modules that must be importable

    def missing_requirements(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


VLLM_CONNECTORS: tuple[ConnectorSpec, ...] = (
    ConnectorSpec(
        name="PdNixlConnector",
        module_path="pd_plugins.connectors.vllm.pd_nixl",
        class_name="PdNixlConnector",
        requires=("nixl",),
    ),
    ConnectorSpec(
        name="PdShmConnector",
        module_path="pd_plugins.connectors.vllm.pd_shm",
        class_name="PdShmConnector",
        requires=("numpy", "torch"),
    ),
    ConnectorSpec(
        name="PdLMCacheConnector",
        module_path="pd_plugins.connectors.vllm.pd_lmcache",
        class_name="PdLMCacheConnector",
        requires=("lmcache",),
    ),
)

# Test only (upstream's NIXL connector with our fault hooks, no verification: the upstream
# comparison of issue 28), registered only where the engine's environment allows KV faults.
TEST_CONNECTORS: tuple[ConnectorSpec, ...] = (
    ConnectorSpec(
        name="FaultyNixlConnector",
        module_path="pd_plugins.testing.fault_connectors",
        class_name="FaultyNixlConnector",
        requires=("nixl",),
    ),
)


def allowed_test_connectors(environ: Mapping[str, str]) -> tuple[ConnectorSpec, ...]:
    """TEST_CONNECTORS where `environ` allows KV faults (transfer/kv_faults.py), else none."""
    return TEST_CONNECTORS if refusal(environ) is None else ()
