"""Expert signatures for ELDR, as a connector option (`kv_connector_extra_config.expert_signatures`).

On a prefill (kv_producer or kv_both) of a MoE model, the worker captures which experts each
prompt's tokens chose (patches/moe_capture.py) and pushes each finished prompt's signature to its
scheduler process (transfer/signature_channel.py); the scheduler puts it in the `pd` section of
the prefill's answer as `experts`, where pd-router's ELDR pieces read it. Off by default: no
capture hook and no socket unless enabled.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from pd_plugins.connectors.vllm.options import extra_flag
from pd_plugins.transfer.signature_channel import ResultReceiver, ResultSender, channel_address

logger = logging.getLogger("pd_plugins")

OPTION = "expert_signatures"


class ExpertSignatures:
    def __init__(self, vllm_config, role: KVConnectorRole) -> None:
        config = vllm_config.kv_transfer_config
        self.enabled = (extra_flag(config, OPTION)
                        and config.kv_role in ("kv_producer", "kv_both"))
        self._capture = self._sender = self._receiver = None
        if not self.enabled:
            return
        from pd_plugins.patches.moe_capture import CHECKED, install, version_supported
        from pd_plugins.patches.vllm_version import installed_vllm

        # Asked for and impossible: refused at startup (a capture that never runs left every
        # finished prefill waiting for a signature in the scheduler, and the log silent).
        if not version_supported():
            raise RuntimeError(f"{OPTION}: the expert capture hooks vLLM internals checked on "
                               f"{CHECKED}, not on the installed {installed_vllm()}; set "
                               f"kv_connector_extra_config.{OPTION} to false")
        if getattr(vllm_config, "use_v2_model_runner", False):
            raise RuntimeError(f"{OPTION}: the expert capture hooks vLLM's V1 model runner, and "
                               "this engine runs V2; set VLLM_USE_V2_MODEL_RUNNER=0, or "
                               f"kv_connector_extra_config.{OPTION} to false")
        if vllm_config.model_config.get_num_experts() <= 0:
            logger.warning("pd-plugins: %s ignored: %s is not a MoE model", OPTION,
                           vllm_config.model_config.model)
            self.enabled = False  # nothing to capture: no waiting for signatures
            return
        address = channel_address(config.engine_id)
        if role == KVConnectorRole.SCHEDULER:
            self._receiver = ResultReceiver(address)
            return

        self._capture = install(vllm_config)
        if self._capture is not None and vllm_config.parallel_config.rank == 0:
            self._sender = ResultSender(address)

    def after_step(self) -> None:
        """Worker side, after each forward pass: send the prompts completed in it."""
        if self._sender is not None:
            self._sender.send(self._capture.take_signatures())

    def take(self, request_id: str) -> dict[str, Any] | None:
        """Scheduler side, when a prefill finishes: its signature (wire form), if one came."""
        if self._receiver is None:
            return None
        signature = self._receiver.take(request_id)
        if signature is None:
            logger.warning("pd-plugins: no expert signature for request %s", request_id)
        return signature

    def close(self) -> None:
        for sock in (self._sender, self._receiver):
            if sock is not None:
                sock.close()
