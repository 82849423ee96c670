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

    # vLLM calls every general plugin in every vLLM process without catching what it raises:
    # nothing here may stop an engine that does not even use pd-plugins
    registered = []
    for spec in (*VLLM_CONNECTORS, *allowed_test_connectors(os.environ)):
        missing = spec.missing_requirements()
        if missing:
            logger.info("pd-plugins: %s not registered, missing %s", spec.name, ", ".join(missing))
            continue
        try:
            KVConnectorFactory.register_connector(spec.name, spec.module_path, spec.class_name)
        except ValueError:  # registered already (this plugin ran before in this process)
            continue
        except Exception as exc:  # noqa: BLE001 - a factory of another vLLM: leave it alone
            logger.warning("pd-plugins: cannot register %s with vLLM (%r); skipping", spec.name,
                           exc)
            continue
        registered.append(spec.name)
    return registered
