"""PdNixlConnector: vLLM's own NIXL connector (pull or push) plus what a PD router needs.

Selected with `--kv-transfer-config '{"kv_connector":"PdNixlConnector", ...}'` and
`kv_connector_extra_config.mode` = "pull" (decode READs, default) or "push" (prefill WRITEs).
All transfer machinery (handshake, lease, heartbeat, transfers) is upstream's; this adapter adds:
- a `pd` section in the prefill response's kv_transfer_params (see transfer_params.PdSection);
- validation of the decode request's transfer params: malformed ones are reported to vLLM as a
  failed KV load, so vLLM's `kv_load_failure_policy` (fail | recompute) decides, instead of the
  engine crashing or reading from a bad address.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
    NixlPushConnector,
)
from vllm.logger import init_logger

from pd_plugins.connectors.transfer_params import (
    PD_SECTION_KEY,
    PdSection,
    TransferMode,
    remote_prefill_error,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

TRANSFER_MODES: tuple[TransferMode, ...] = ("pull", "push")


def transfer_mode_of(vllm_config: VllmConfig) -> TransferMode:
    config = vllm_config.kv_transfer_config
    mode = config.get_from_extra_config("mode", "pull") if config is not None else "pull"
    if mode not in TRANSFER_MODES:
        raise ValueError(
            f"PdNixlConnector: kv_connector_extra_config.mode must be one of "
            f"{', '.join(TRANSFER_MODES)}, got {mode!r}"
        )
    return mode


class _PdAdditions:
    """Mixed in front of an upstream NIXL connector (pull or push)."""

    pd_mode: TransferMode

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        # Scheduler side.
        self._local_prefix_hits: dict[str, int] = {}  # request id -> tokens hit locally
        self._params_rejected: set[str] = set()  # await allocation, then reported failed
        self._rejections_to_report: set[str] = set()  # shipped to workers next step

    # ---- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # vLLM passes the local prefix-cache hit here: remember it for the pd section.
        self._local_prefix_hits[request.request_id] = num_computed_tokens
        if not self._disarm_unusable_params(request):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        logger.error(
            "PdNixlConnector: request %s has unusable kv_transfer_params (%s); its KV load "
            "is treated as failed and kv_load_failure_policy applies",
            request.request_id,
            request.kv_transfer_params["pd_rejected_reason"],
        )
        missing = request.num_prompt_tokens - num_computed_tokens
        if missing <= 0:  # fully cached locally: nothing to load, nothing to fail
            return 0, False
        # Claim the missing tokens as an async load so the request parks in
        # WAITING_FOR_REMOTE_KVS; the worker then reports it as a failed receive.
        self._params_rejected.add(request.request_id)
        return missing, True

    def _disarm_unusable_params(self, request: Request) -> bool:
        """Turn off remote loading for malformed params; True if it did.

        Upstream reads these fields unchecked (a missing one raises in the scheduler and kills the
        engine), so malformed params must never reach it: not when the request is scheduled, and
        not when it finishes unscheduled (vLLM's API layer aborts a rejected request with its
        original params, and upstream then tries to notify the remote prefill).
        """
        params = request.kv_transfer_params
        error = remote_prefill_error(params, self.pd_mode) if params else None
        if error is None:
            return False
        params["do_remote_prefill"] = False
        params["pd_rejected_reason"] = error
        return True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        if request.request_id in self._params_rejected:
            self._params_rejected.discard(request.request_id)
            self._rejections_to_report.add(request.request_id)
            return None
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        meta.pd_rejected_recv = self._rejections_to_report
        self._rejections_to_report = set()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]):
        self._disarm_on_finish(request)
        return self._with_pd_section(request, super().request_finished(request, block_ids))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]):
        self._disarm_on_finish(request)
        return self._with_pd_section(
            request, super().request_finished_all_groups(request, block_ids)
        )

    def _disarm_on_finish(self, request: Request) -> None:
        if self._disarm_unusable_params(request):
            logger.warning("PdNixlConnector: request %s finished with unusable "
                           "kv_transfer_params; no remote engine is notified", request.request_id)

    def _with_pd_section(
        self, request: Request, result: tuple[bool, dict[str, Any] | None]
    ) -> tuple[bool, dict[str, Any] | None]:
        local_hit = self._local_prefix_hits.pop(request.request_id, 0)
        self._params_rejected.discard(request.request_id)
        delay_free, out_params = result
        was_prefill = bool((request.kv_transfer_params or {}).get("do_remote_decode"))
        if out_params is not None and was_prefill:
            section = PdSection(
                prompt_tokens=request.num_prompt_tokens,
                cached_tokens=local_hit,
                engine_id=self.engine_id,
                mode=self.pd_mode,
                block_size=self._block_size,
            )
            out_params[PD_SECTION_KEY] = msgspec.to_builtins(section)
        return delay_free, out_params

    # ---- worker side ----------------------------------------------------------------------
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        rejected = getattr(self._connector_metadata, "pd_rejected_recv", None)
        if rejected:
            # vLLM expects failed receives in finished_recving too.
            results.failed_recving |= rejected
            results.finished_recving |= rejected
        return results


class PdNixlPullConnector(_PdAdditions, NixlPullConnector):
    pd_mode: TransferMode = "pull"


class PdNixlPushConnector(_PdAdditions, NixlPushConnector):
    pd_mode: TransferMode = "push"


class PdNixlConnector(NixlBaseConnector):
    """The name users select; builds the pull or push variant from the config's `mode`."""

    def __new__(
        cls, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        variant = {"pull": PdNixlPullConnector, "push": PdNixlPushConnector}[
            transfer_mode_of(vllm_config)
        ]
        return variant(vllm_config, role, kv_cache_config)
