"""Entry point `vllm.general_plugins`: registers pd-plugins connectors with vLLM.

vLLM calls this in every process it starts (API server, engine core, workers), possibly more than
once, so it must be idempotent and cheap, and it must never break an engine start: a connector
whose optional dependency is missing is logged and skipped.
"""

from __future__ import annotations

import logging
import os

from pd_plugins.connectors.registry import VLLM_CONNECTORS, allowed_test_connectors

logger = logging.getLogger("pd_plugins")


def register() -> list[str]:
    """Register every available connector; return the names registered by this call."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception as exc:  # an engine too old or broken: leave it alone
        logger.warning("pd-plugins: vLLM KV connector factory unavailable (%s); skipping", exc)
        return []

    registered = []
    for spec in (*VLLM_CONNECTORS, *allowed_test_connectors(os.environ)):
        if spec.name in KVConnectorFactory._registry:
            continue
        missing = spec.missing_requirements()
        if missing:
            logger.info("pd-plugins: %s not registered, missing %s", spec.name, ", ".join(missing))
            continue
        KVConnectorFactory.register_connector(spec.name, spec.module_path, spec.class_name)
        registered.append(spec.name)
    return registered
