"""Test only: upstream's NIXL connectors with pd-plugins' KV fault hooks and no verification
(issue 28, docs/plans/kv-verification.md §6 "Upstream comparison").

`FaultyNixlConnector` is vLLM's own NixlPullConnector / NixlPushConnector (picked by
`kv_connector_extra_config.mode`, like PdNixlConnector) with the faults PdNixlConnector injects,
from the same spec (`kv_connector_extra_config.faults`, transfer/kv_faults.py), so the same
injections show what upstream does with damaged KV:

- `corrupt` (decode, pull and push): XOR one byte of one block a finished read (or push) landed,
  before the engine computes from it (BlockVerifier.damage, as PdNixlConnector does);
- `reuse` (decode, pull and push): overwrite one landed block with the next block of the KV cache
  whose bytes differ (pd_nixl_verify.other_block), as a block reused by another request would
  hold it;
- `drop_write` (push prefill): skip the WRITE and send upstream's completion notification
  (`<decode request id>:<world size>`) to the decode, which then computes from whatever its
  blocks held. The prefill's blocks are freed when its lease runs out.

It is registered only when the engine's environment allows faults (connectors/registry.py
`allowed_test_connectors`) and refuses to start otherwise or under PD_PRODUCTION
(KvFaults.from_spec). Injections count in `vllm:pd_kv_faults_injected_total` on /metrics
(PdNixlConnector's counter table) and are logged per request. Besides the hooks, one change from
upstream: an engine keeps its CPU binding, as PdNixlConnector's `keep_cpu_affinity` does
(upstream's worker moves the model's thread to the last core, so two engines on a 2-core host
would compute on one; that is about this host, not about KV). Upstream privates used besides
nixl_internals': the push worker's `_xfer_blocks` and `world_size`
(tests/unit/connectors/test_fault_connectors.py checks they exist).
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlBaseConnector,
    NixlPullConnector,
    NixlPushConnector,
)
from vllm.logger import init_logger

from pd_plugins.connectors.vllm.block_verifier import BlockVerifier
from pd_plugins.connectors.vllm.kv_verdicts import FAULTS_INJECTED_KEY
from pd_plugins.connectors.vllm.nixl_internals import remote_agent
from pd_plugins.connectors.vllm.options import extra_options
from pd_plugins.connectors.vllm.pd_nixl import _PdStatsClassMethods, transfer_mode_of
from pd_plugins.connectors.vllm.pd_nixl_guards import BoundedDict
from pd_plugins.connectors.vllm.pd_nixl_stats import PdNixlStats
from pd_plugins.connectors.vllm.pd_nixl_verify import damage_landed
from pd_plugins.transfer.kv_faults import KvFaults, refusal
from pd_plugins.transfer.options import KvFaultOptions, OptionError

logger = init_logger(__name__)

NAME = "FaultyNixlConnector"
MAX_TRACKED = 65536  # landed reads remembered between steps (oldest forgotten first)


class _FaultHooks(_PdStatsClassMethods):
    """Mixed in front of upstream's NIXL pull or push connector."""

    pd_mode: str

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        config = vllm_config.kv_transfer_config
        # refused here (the engine does not start) unless allowed, in every engine process, with
        # or without faults set: this connector exists only for tests
        why = refusal(os.environ)
        if why is not None:
            raise OptionError(f"{NAME}: a test connector, refused: {why}")
        self._faults = KvFaults.from_spec(extra_options(KvFaultOptions, config, NAME).faults, NAME)
        worker = role == KVConnectorRole.WORKER
        bound = os.sched_getaffinity(0) if worker and hasattr(os, "sched_getaffinity") else None
        super().__init__(vllm_config, role, kv_cache_config)
        if bound is not None and os.sched_getaffinity(0) != bound:
            os.sched_setaffinity(0, bound)
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._num_blocks = kv_cache_config.num_blocks
        self._blocks: BlockVerifier | None = None
        self._landing: BoundedDict = BoundedDict(MAX_TRACKED)  # req id -> local block ids
        self._counted = 0  # injections already on /metrics
        if worker:
            self.connector_worker.xfer_stats = PdNixlStats()
            if self.pd_mode == "push" and self._faults.handles("drop_write"):
                self._drop_writes(self.connector_worker)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        if self._faults.handles("corrupt") or self._faults.handles("reuse"):
            self._blocks = BlockVerifier([kv_caches[n] for n in self._layer_names],
                                         self._num_blocks)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._blocks is not None and self.has_connector_metadata():
            # upstream consumes the reads' metadata in its own calls: keep the landing blocks
            for req_id, read in getattr(self._get_connector_metadata(), "reqs_to_recv",
                                        {}).items():
                if read.local_block_ids and read.local_block_ids[0]:
                    self._landing[req_id] = list(read.local_block_ids[0])
        return super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        if self._blocks is not None:
            for req_id in results.finished_recving - results.failed_recving:
                landed = self._landing.pop(req_id, None)
                if landed is not None:
                    damage_landed(self._faults, self._blocks, req_id, landed)
            for req_id in finished_req_ids:
                self._landing.pop(req_id, None)
        # counted here, on the engine's thread: drop_write injects on upstream's writer thread
        injected = sum(self._faults.injected.values())
        self.connector_worker.xfer_stats.count(FAULTS_INJECTED_KEY, injected - self._counted)
        self._counted = injected
        return results

    def _drop_writes(self, worker: Any) -> None:
        """Push prefill: a targeted WRITE is not posted; its completion notification is sent."""
        write, faults = worker._xfer_blocks, self._faults

        def xfer_blocks(*, read_spec: Any, dst_engine_id: str, request_id: str,
                        remote_request_id: str, **kwargs: Any) -> int | None:
            agent = remote_agent(worker, dst_engine_id, read_spec.remote_rank)
            if agent is None or faults.take("drop_write", request_id) is None:
                return write(read_spec=read_spec, dst_engine_id=dst_engine_id,
                             request_id=request_id, remote_request_id=remote_request_id,
                             **kwargs)
            worker.nixl_wrapper.send_notif(
                agent, notif_msg=f"{remote_request_id}:{worker.world_size}".encode())
            return None  # no handle: the prefill's blocks wait for their lease to run out

        worker._xfer_blocks = xfer_blocks


class FaultyNixlPullConnector(_FaultHooks, NixlPullConnector):
    pd_mode = "pull"


class FaultyNixlPushConnector(_FaultHooks, NixlPushConnector):
    pd_mode = "push"


class FaultyNixlConnector(_PdStatsClassMethods, NixlBaseConnector):
    """The name tests select; builds the pull or push variant from the config's `mode`."""

    def __new__(cls, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        variant = {"pull": FaultyNixlPullConnector, "push": FaultyNixlPushConnector}[
            transfer_mode_of(vllm_config)]
        return variant(vllm_config, role, kv_cache_config)
