"""PdNixlConnector: vLLM's own NIXL connector (pull or push) plus what a PD router needs.

Selected with `--kv-transfer-config '{"kv_connector":"PdNixlConnector", ...}'` and
`kv_connector_extra_config.mode` = "pull" (decode READs, default) or "push" (prefill WRITEs).
All transfer machinery (handshake, lease, heartbeat, transfers) is upstream's; this adapter adds:
- a `pd` section in the prefill response's kv_transfer_params (see transfer_params.PdSection);
- validation of the decode request's transfer params: malformed ones are reported to vLLM as a
  failed KV load, so vLLM's `kv_load_failure_policy` (fail | recompute) decides, instead of the
  engine crashing or reading from a bad address; params that are not an object at all (a client's
  `vllm_xargs`) are dropped on arrival and the request runs without remote KV;
- pull: lease checks. A decode uses KV it read only once the prefill confirms its lease still
  held the blocks when the read finished; a late read is a failed load (transfer/lease_check.py);
- push: a deadline on every transfer (`push_timeout_s`) on the decode; on the prefill no WRITE
  after its lease or the decode's deadline, and no freeing of blocks under an in-flight WRITE
  (pd_nixl_guards.py);
- verified KV (`verify_kv`, on by default; pd_nixl_verify.py): the prefill states a digest of
  each prompt block (pull: in its `pd` section; push: in a NIXL notification before the WRITE),
  the decode checks the blocks that landed against them; a mismatch is a failed load from the
  first bad block, and the decode's answer says what happened (`pd.kv`: verified, recomputed,
  failed or unverified);
- no peer or request ends the engine through upstream's code on its main thread: every worker
  drops the NIXL notifications upstream cannot parse (pd_nixl_guards.NotifFilter), block lists a
  pull read cannot take are refused, and a pull read whose start raises is a failed load
  (pd_nixl_guards.ReadStarts);
- counters for all of it on /metrics (pd_nixl_stats.py).
Every failed load goes through vLLM's `kv_load_failure_policy` (fail | recompute).
Upstream's private names are used only through nixl_internals.py, for checked vLLM versions.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
    NixlPushConnector,
)
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from pd_plugins.connectors.transfer_params import lease_check_of, malformed_params_error, remote_prefill_error
from pd_plugins.vocab.engines import TransferMode
from pd_plugins.vocab.transfer_params import PD_SECTION_KEY, PdSection
from pd_plugins.connectors.vllm.block_verifier import BlockVerifier
from pd_plugins.connectors.vllm.counter_stats import REJECTED_PARAMS_KEY
from pd_plugins.connectors.vllm.kv_verdicts import (
    FAULTS_INJECTED_KEY,
    VerdictBook,
    count_digest_cost,
    verdict_key,
)
from pd_plugins.connectors.vllm.expert_signatures import ExpertSignatures
from pd_plugins.connectors.vllm.options import extra_options
from pd_plugins.connectors.vllm.pd_nixl_guards import (
    LeaseVerdicts,
    NotifFilter,
    NotifTap,
    WRITE_BY_KEY,
    WRITE_MARGIN_S,
    PushDeadlines,
    ReadStarts,
    SendHold,
    WriteGate,
)
from pd_plugins.connectors.vllm.nixl_internals import (
    exchanged_blocks,
    holds_blocks,
    pending_push_registration,
    remote_agents,
    require_checked_vllm,
    sends_in_flight,
    transfer_tp_size,
    unverifiable_layout,
)
from pd_plugins.connectors.vllm.pd_nixl_stats import PdNixlPromMetrics, PdNixlStats
from pd_plugins.connectors.vllm.pd_nixl_verify import (
    ACCEPTS_DIGESTS_KEY,
    DigestChannel,
    DigestInbox,
    DigestPlan,
    LoadVerifier,
    PdNixlWorkerMeta,
    PushDigestSender,
    expected_digests,
    group0,
)
from pd_plugins.transfer.kv_faults import KvFaults
from pd_plugins.transfer.lease_check import LateReadGuard, LeaseCheck, LeaseCheckServer
from pd_plugins.transfer.options import KvFaultOptions, NixlOptions
from pd_plugins.transfer.transfer_threads import lowered_new_threads, paced_progress

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)


def nixl_options(vllm_config: VllmConfig) -> NixlOptions:
    """This connector's options (transfer/options.py; SGLang's pd-nixl reads the same)."""
    return extra_options(NixlOptions, vllm_config.kv_transfer_config, "PdNixlConnector")


def _give_upstream_the_checked_lease(kv_transfer_config: Any, options: NixlOptions) -> None:
    """Upstream reads `kv_lease_duration` raw and does arithmetic on it: a lease written as a
    string ("30", as CLI JSON often has it) passed our checks and then stopped the engine at
    startup with a TypeError naming no key. Upstream gets the checked number."""
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None)
    if isinstance(extra, dict) and "kv_lease_duration" in extra:
        lease = options.kv_lease_duration
        extra["kv_lease_duration"] = int(lease) if lease.is_integer() else lease


def transfer_mode_of(vllm_config: VllmConfig) -> TransferMode:
    return nixl_options(vllm_config).mode


class _PdStatsClassMethods:
    """vLLM builds connector stats and metrics from the class the user named: ours."""

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdNixlStats:
        return PdNixlStats(data=data) if data is not None else PdNixlStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return PdNixlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def transfer_threads(vllm_config: VllmConfig) -> tuple[int | None, int | None]:
    """(nice, progress wait in us) for the threads upstream's NIXL agent starts:
    `kv_connector_extra_config.transfer_threads_nice` (by default 19 on a CPU engine of one
    worker, untouched elsewhere: NixlOptions.nice_on) and `progress_wait_us` (by default 1000 on
    a CPU engine); transfer/transfer_threads.py says why."""
    from vllm.platforms import current_platform

    options, cpu_engine = nixl_options(vllm_config), current_platform.is_cpu()
    return (options.nice_on(cpu_engine=cpu_engine,
                            engine_workers=vllm_config.parallel_config.world_size),
            options.progress_wait_on(cpu_engine))


class _PdAdditions(_PdStatsClassMethods):
    """Mixed in front of an upstream NIXL connector (pull or push)."""

    pd_mode: TransferMode

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        require_checked_vllm()  # before upstream's connector, whose internals we use
        # On CPU, upstream's NIXL worker moves the calling thread to the last core of each NUMA
        # node ("reserved for KV transfer"). That thread is the one that runs the model (with one
        # OMP thread per bound core, OMP's master is the main thread), so two engines bound to
        # cores 0 and 1 both computed on core 1, a busy-stepping prefill starving its decode: the
        # concurrent-pull stalls (docs/connectors.md, "Under load"). Keep the engine's own binding.
        options = nixl_options(vllm_config)
        _give_upstream_the_checked_lease(vllm_config.kv_transfer_config, options)
        keep = (role == KVConnectorRole.WORKER and hasattr(os, "sched_getaffinity")
                and options.keep_cpu_affinity)
        bound = os.sched_getaffinity(0) if keep else None
        nice, wait_us = (transfer_threads(vllm_config) if role == KVConnectorRole.WORKER
                          else (None, None))
        with lowered_new_threads(nice, "PdNixlConnector"), \
                paced_progress(wait_us, "PdNixlConnector"):  # upstream's NIXL agent starts them
            super().__init__(vllm_config, role, kv_cache_config)
        if bound is not None and os.sched_getaffinity(0) != bound:
            logger.info("PdNixlConnector: keeping this engine's CPU binding %s (upstream NIXL "
                        "moved it to %s)", sorted(bound), sorted(os.sched_getaffinity(0)))
            os.sched_setaffinity(0, bound)
        config = vllm_config.kv_transfer_config
        self._block_size = vllm_config.cache_config.block_size
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._dcp_size = vllm_config.parallel_config.decode_context_parallel_size
        self._recompute_failed_loads = config.kv_load_failure_policy == "recompute"
        self._reads = config.kv_role in ("kv_consumer", "kv_both")   # decode side
        self._serves = config.kv_role in ("kv_producer", "kv_both")  # prefill side
        lease_s = options.kv_lease_duration
        self._push_timeout_s = options.push_timeout
        # Scheduler side.
        self._local_prefix_hits: dict[str, int] = {}  # request id -> tokens hit locally
        self._params_rejected: set[str] = set()  # await allocation, then reported failed
        self._rejections_to_report: set[str] = set()  # shipped to workers next step
        self._lease_checks_to_send: dict[str, LeaseCheck | None] = {}
        self._push_waits_to_send: dict[str, float] = {}
        self._malformed_params = 0  # not yet counted on /metrics
        self._lease_server: LeaseCheckServer | None = None
        if role == KVConnectorRole.SCHEDULER and self.pd_mode == "pull" and self._serves:
            host = socket.gethostbyname(self.connector_scheduler.side_channel_host)
            self._lease_server = LeaseCheckServer(
                host, options.lease_check_port)
        # Worker side.
        self._notif_tap: NotifTap | None = None
        self._late_read_guard: LateReadGuard | None = None
        self._read_starts: ReadStarts | None = None
        self._lease_checks: dict[str, LeaseCheck | None] = {}
        self._push_deadlines: PushDeadlines | None = None
        self._send_hold: SendHold | None = None
        self._write_gate: WriteGate | None = None
        if role == KVConnectorRole.WORKER:
            self._set_up_worker_guards(lease_s)
        self._experts = ExpertSignatures(vllm_config, role)
        self._set_up_verification(vllm_config, role, kv_cache_config, options)
        self._notif_filter: NotifFilter | None = None
        if role == KVConnectorRole.WORKER:
            self._set_up_notif_filter()

    def _set_up_notif_filter(self) -> None:
        """Outermost around the worker's NIXL agent (over a push decode's DigestInbox, which takes
        the digest notifications first): upstream's parser sees only what it can parse."""
        worker = self.connector_worker
        if self._notif_tap is not None:  # pull prefill: the tap filters too
            self._notif_filter = self._notif_tap
            return
        push = self.pd_mode == "push"
        tp_size = functools.partial(transfer_tp_size, worker) if push and self._serves else None
        worker.nixl_wrapper = self._notif_filter = NotifFilter(worker.nixl_wrapper, push=push,
                                                               tp_size=tp_size)

    def _set_up_verification(self, vllm_config: VllmConfig, role: KVConnectorRole,
                             kv_cache_config: KVCacheConfig, options: NixlOptions) -> None:
        """Verified KV (pd_nixl_verify.py): pull reads and push WRITEs."""
        config = vllm_config.kv_transfer_config
        # refused at start unless allowed (transfer/kv_faults.py), in every process of the engine
        self._faults = KvFaults.from_spec(
            extra_options(KvFaultOptions, config, "PdNixlConnector").faults, "PdNixlConnector")
        verify = options.verify_kv
        tp = vllm_config.parallel_config.tensor_parallel_size
        scheduler = role == KVConnectorRole.SCHEDULER
        self._kv_cache_config = kv_cache_config
        self._scheduler_stats: PdNixlStats | None = None
        self._digest_plan: DigestPlan | None = None
        self._digest_channel: DigestChannel | None = None
        self._verdicts: VerdictBook | None = None
        self._digests_to_send: dict[str, tuple[str | None, str | None]] = {}
        self._block_verifier: BlockVerifier | None = None
        self._load_verifier: LoadVerifier | None = None
        self._push_digests: PushDigestSender | None = None
        self._digest_inbox: DigestInbox | None = None
        if verify == "off":
            return
        fixed = (f"TP {tp} (only TP 1 is checked)" if tp != 1
                 else "several KV cache groups" if len(kv_cache_config.kv_cache_groups) != 1
                 else None)
        worker = self.connector_worker
        layout_why = lambda: fixed or unverifiable_layout(worker)  # noqa: E731
        if self._serves and tp == 1 and self.pd_mode == "pull":
            # digests of TP > 1 ranks: not yet (decodes: unverified)
            self._digest_plan = DigestPlan() if scheduler else None
            self._digest_channel = DigestChannel(config.engine_id, scheduler=scheduler)
        if self._serves and tp == 1 and self._write_gate is not None:  # push prefill worker
            self._push_digests = PushDigestSender(worker, lambda: self._block_verifier,
                                                  layout_why, self._faults)
            self._write_gate.before_write = self._push_digests.before_write
        if self._reads and scheduler:
            self._verdicts = VerdictBook(self.pd_mode, recompute=self._recompute_failed_loads)
        if self._reads and not scheduler:
            inbox = None
            if self.pd_mode == "push":  # the prefills' digests come by NIXL notification
                worker.nixl_wrapper = self._digest_inbox = inbox = DigestInbox(worker.nixl_wrapper)
            self._load_verifier = LoadVerifier(lambda: self._block_verifier, layout_why,
                                               required=verify == "required",
                                               faults=self._faults,
                                               stats=self.connector_worker.xfer_stats,
                                               inbox=inbox,
                                               senders_of=functools.partial(remote_agents,
                                                                            worker))

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        if (self._digest_channel is None and self._load_verifier is None
                and self._push_digests is None):
            return
        config = self._kv_cache_config
        try:
            self._block_verifier = BlockVerifier(
                [kv_caches[n] for n in config.kv_cache_groups[0].layer_names], config.num_blocks)
        except (KeyError, ValueError) as exc:
            logger.warning("PdNixlConnector: KV blocks cannot be digested (%s): reads are "
                           "unverified", exc)

    def _count_on_scheduler(self, key: str, n: float = 1) -> None:
        if self._scheduler_stats is None:
            self._scheduler_stats = PdNixlStats()
        self._scheduler_stats.count(key, n)

    def _set_up_worker_guards(self, lease_s: float) -> None:
        worker = self.connector_worker
        worker.xfer_stats = PdNixlStats()
        if self.pd_mode == "pull":
            if self._serves:
                worker.nixl_wrapper = self._notif_tap = NotifTap(
                    worker.nixl_wrapper, functools.partial(holds_blocks, worker), worker.tp_rank)
            if self._reads:
                self._late_read_guard = LateReadGuard(reader=worker.nixl_wrapper.name)
                self._read_starts = ReadStarts(worker)
        else:
            if self._reads:
                self._push_deadlines = PushDeadlines(worker)
            if self._serves:
                self._write_gate = WriteGate(worker)
                self._send_hold = SendHold(max_hold_s=lease_s,
                                           decode_deadline=self._write_gate.decode_deadline)

    # ---- scheduler side -------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        # The first connector call for a request, and upstream's first `.get` on its params.
        error = malformed_params_error(request.kv_transfer_params)
        if error is not None:
            logger.warning("PdNixlConnector: request %s: %s; ignored, served without remote KV",
                           request.request_id, error)
            request.kv_transfer_params = None
            self._malformed_params += 1
        super().on_new_request(request)

    def get_kv_connector_stats(self) -> PdNixlStats | None:
        if self.connector_worker is not None:
            count_digest_cost(self.connector_worker.xfer_stats, self._block_verifier)
            return super().get_kv_connector_stats()
        if self._malformed_params:
            self._count_on_scheduler(REJECTED_PARAMS_KEY, self._malformed_params)
            self._malformed_params = 0
        stats, self._scheduler_stats = self._scheduler_stats, None
        return stats

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # vLLM passes the local prefix-cache hit here: remember it for the pd section.
        self._local_prefix_hits[request.request_id] = num_computed_tokens
        if request.request_id in self._params_rejected:
            # asked again (its allocation failed last step): its params are disarmed already,
            # and it still parks to be failed, unless the cache now holds all of it
            missing = request.num_prompt_tokens - num_computed_tokens
            if missing > 0:
                return missing, True
            self._params_rejected.discard(request.request_id)
            return 0, False
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
        if error is None and params and params.get("do_remote_prefill"):
            error = self._tp_pairing_error(params["tp_size"])
        if error is None and params and params.get("do_remote_prefill") and self.pd_mode == "pull":
            error = self._block_lists_error(params["remote_block_ids"])
        if error is None:
            return False
        params["do_remote_prefill"] = False
        params["pd_rejected_reason"] = error
        return True

    def _tp_pairing_error(self, prefill_tp: int) -> str | None:
        """Upstream maps heads between ranks only when one TP size divides the other, and asserts
        so in its handshake thread (a hung request, not an answer): refuse the load up front."""
        small, large = sorted((prefill_tp, self._tp_size))
        if large % small == 0:
            return None
        return (f"the prefill has TP {prefill_tp} and this decode TP {self._tp_size}: one must "
                "divide the other for NIXL to map KV heads between their ranks")

    def _block_lists_error(self, block_ids: list) -> str | None:
        """Upstream reads one block list per KV cache group it transfers and asserts the count in
        the worker's read path (an engine killed by a request): refuse another count up front."""
        groups = len(self._kv_cache_config.transfer_groups)
        if not block_ids:  # nothing to read (a full prefix hit)
            return None
        lists = len(block_ids) if isinstance(block_ids[0], (list, tuple)) else 1
        if lists == groups:
            return None
        return (f"kv_transfer_params.remote_block_ids has {lists} block list(s), this decode's "
                f"model has {groups} KV cache group(s)")

    def _short_block_lists_error(self, params: dict[str, Any], blocks: KVCacheBlocks
                                 ) -> str | None:
        """Upstream asserts in the worker's read path (on the engine's main thread) that the
        prefill lists at least as many blocks per group as the decode reads into, and in the
        scheduler that an empty list comes with nothing to load: refuse such lists up front.
        The count is checked where it must hold: the prefill states this decode's block size
        (its `pd` section, or `remote_block_size`), attention groups, no decode context
        parallelism on either side (a DCP prefill states its per-rank block size, but its
        scheduler's blocks cover block_size x dcp_size tokens, so it lists fewer: upstream's
        pull worker pairs those); any other read that cannot start fails in the worker
        (ReadStarts)."""
        from vllm.v1.kv_cache_interface import AttentionSpec

        remote = params["remote_block_ids"]  # checked by remote_prefill_error
        if not remote:  # upstream asserts there is nothing to load (in the scheduler)
            return ("kv_transfer_params.remote_block_ids is empty, and this decode has tokens "
                    "to load")
        section = params.get(PD_SECTION_KEY)
        stated = section.get("block_size") if isinstance(section, dict) else None
        stated = params.get("remote_block_size") or stated
        if stated != self._block_size or self._dcp_size != 1:
            return None
        if params.get("dcp_size") not in (None, 1):  # upstream's field: the prefill's DCP size
            return None
        if not isinstance(remote[0], (list, tuple)):
            remote = [remote]
        local = exchanged_blocks(self.connector_scheduler, blocks)
        groups = self._kv_cache_config.transfer_groups
        for g, (group, theirs, mine) in enumerate(zip(groups, remote, local)):
            if isinstance(group.kv_cache_spec, AttentionSpec) and len(theirs) < len(mine):
                return (f"kv_transfer_params.remote_block_ids lists {len(theirs)} block(s) for "
                        f"KV cache group {g}, this decode reads {len(mine)} there")
        return None

    def _lease_check(self, params: dict[str, Any]) -> LeaseCheck | None:
        """Where to ask whether a pull read was on time, and from how many prefill ranks: a
        decode of a smaller TP reads each of its heads' slices from another prefill rank
        (upstream's TransferTopology), each with its own notification and verdict."""
        check = lease_check_of(params)
        if check is None:
            return None
        prefill_tp = params.get("tp_size", 1)  # validated by remote_prefill_error
        return (*check, max(1, prefill_tp // self._tp_size))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        if request.request_id in self._params_rejected:
            self._params_rejected.discard(request.request_id)
            # reported only if vLLM parked it in WAITING_FOR_REMOTE_KVS: a request that skips
            # the prefix cache (prompt_logprobs) runs with 0 external tokens, and a failed
            # receive reported for a running request fails vLLM's assertions (the engine dies)
            if num_external_tokens > 0:
                self._rejections_to_report.add(request.request_id)
            return None
        params = request.kv_transfer_params
        if (self.pd_mode == "pull" and params and params.get("do_remote_prefill")
                and num_external_tokens > 0):
            error = self._short_block_lists_error(params, blocks)
            if error is not None:
                logger.error("PdNixlConnector: request %s has unusable kv_transfer_params (%s); "
                             "its KV load is treated as failed and kv_load_failure_policy "
                             "applies", request.request_id, error)
                params["do_remote_prefill"] = False
                params["pd_rejected_reason"] = error
                self._rejections_to_report.add(request.request_id)
                return None
        if params and params.get("do_remote_decode") and self._digest_plan is not None:
            self._digest_plan.track(request)  # its prompt's blocks get digests
        if params and params.get("do_remote_prefill") and num_external_tokens > 0:
            # A transfer into this request's blocks starts: guard it (see the module doc).
            if self.pd_mode == "pull":
                self._lease_checks_to_send[request.request_id] = self._lease_check(params)
                if self._verdicts is not None:
                    expected = expected_digests(params, self._block_size)
                    self._digests_to_send[request.request_id] = expected
                    self._verdicts.expect(request.request_id,
                                          -(-num_external_tokens // self._block_size),
                                          checked=expected[0] is not None)
            else:
                self._push_waits_to_send[request.request_id] = self._push_timeout_s
                if self._verdicts is not None:
                    # whether the prefill sends digests shows only when they come: clean is
                    # `unverified` until the worker says otherwise
                    self._verdicts.expect(request.request_id,
                                          -(-num_external_tokens // self._block_size),
                                          checked=False)
        result = super().update_state_after_alloc(request, blocks, num_external_tokens)
        registration = (pending_push_registration(self.connector_scheduler, request.request_id)
                        if self.pd_mode == "push" else None)
        if registration is not None and self._reads:
            # Tell the prefill when this decode stops waiting, so no WRITE lands after that.
            registration[WRITE_BY_KEY] = time.time() + self._push_timeout_s - WRITE_MARGIN_S
            if self._verdicts is not None:  # verify_kv on: this decode checks pushed blocks
                registration[ACCEPTS_DIGESTS_KEY] = True
        return result

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        meta.pd_rejected_recv, self._rejections_to_report = self._rejections_to_report, set()
        meta.pd_lease_checks, self._lease_checks_to_send = self._lease_checks_to_send, {}
        meta.pd_push_waits, self._push_waits_to_send = self._push_waits_to_send, {}
        meta.pd_expected_digests, self._digests_to_send = self._digests_to_send, {}
        meta.pd_digest_blocks = (self._digest_plan.due(
            scheduler_output.num_scheduled_tokens,
            lambda req_id: self._kv_cache_manager.get_block_ids(req_id)[0])
            if self._digest_plan is not None else {})
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput):
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, PdNixlWorkerMeta) and self._verdicts is not None:
            self._verdicts.record(worker_meta.loads)
        if self._lease_server is not None:
            table = self._lease_server.table
            verdicts = (worker_meta.lease if isinstance(worker_meta, PdNixlWorkerMeta)
                        else worker_meta)
            if isinstance(verdicts, LeaseVerdicts):
                verdicts.record_into(table)  # before the releases of the same step
            for request_id in connector_output.finished_sending or ():
                table.release(request_id)
        return super().update_connector_output(connector_output)

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
        req_id = request.request_id
        local_hit = self._local_prefix_hits.pop(req_id, 0)
        self._params_rejected.discard(req_id)
        self._digests_to_send.pop(req_id, None)
        asked = self._digest_plan is not None and self._digest_plan.forget(req_id)
        delay_free, out_params = result
        was_prefill = bool((request.kv_transfer_params or {}).get("do_remote_decode"))
        verdict = None
        if self._verdicts is not None:
            if request.status == RequestStatus.FINISHED_ABORTED:
                # possibly before its read finished: no outcome to judge, nobody to answer
                self._verdicts.drop(req_id)
            else:
                verdict = self._verdicts.verdict(
                    req_id, request.status == RequestStatus.FINISHED_ERROR)
        if verdict is not None:
            self._count_on_scheduler(verdict_key(verdict.verdict))
            if not was_prefill:  # a prefill leg's answer is its decode's params: no verdict
                out_params = verdict.into(out_params)
        if out_params is not None and was_prefill:
            digests = None
            if self._digest_channel is not None:
                digests, why = self._digest_channel.take(req_id, self._block_size, asked)
                if digests is None:
                    if why == "late":  # (a worker that cannot digest said so once, at start)
                        logger.warning("PdNixlConnector: no KV digests for prefill %s in time; "
                                       "its decode loads it unverified", req_id)
                    self._count_on_scheduler("pd_missing_digests")
            section = PdSection(
                prompt_tokens=request.num_prompt_tokens,
                cached_tokens=local_hit,
                engine_id=self.engine_id,
                mode=self.pd_mode,
                block_size=self._block_size,
                lease_check_port=self._lease_server.port if self._lease_server else None,
                experts=self._experts.take(req_id),
                kv_digest=digests,
            )
            out_params[PD_SECTION_KEY] = msgspec.to_builtins(section)
        return delay_free, out_params

    # ---- worker side ----------------------------------------------------------------------
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Push prefill: lease reaping (in upstream's call) and WRITE starts exclude each other.
        with self._write_gate.lock if self._write_gate is not None else contextlib.nullcontext():
            results = super().get_transfer_results(finished_req_ids)
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        rejected = getattr(meta, "pd_rejected_recv", None)
        if rejected:
            # vLLM expects failed receives in finished_recving too.
            results.failed_recving |= rejected
            results.finished_recving |= rejected
        stats: PdNixlStats = self.connector_worker.xfer_stats
        if self._notif_filter is not None:
            stats.count("pd_dropped_notifs", self._notif_filter.take_dropped())
        if self._digest_inbox is not None:
            stats.count("pd_dropped_notifs", self._digest_inbox.take_malformed())
        if self._late_read_guard is not None:
            self._check_leases(results, getattr(meta, "pd_lease_checks", None) or {},
                               finished_req_ids)
        if self._push_deadlines is not None:
            self._push_deadlines.expect(getattr(meta, "pd_push_waits", None) or {})
            timed_out = self._push_deadlines.settle(results.finished_recving,
                                                    results.failed_recving)
            for request_id in timed_out:
                logger.error("PdNixlConnector: push for request %s did not complete within "
                             "%.0f s; its KV load failed", request_id, self._push_timeout_s)
            stats.count("pd_push_timeouts", len(timed_out))
        if self._write_gate is not None:
            stats.count("pd_refused_writes", self._write_gate.take_refused())
        if self._read_starts is not None:
            stats.count("pd_refused_reads", self._read_starts.take_failed())
        if self._send_hold is not None:
            in_flight = sends_in_flight(self.connector_worker)
            stats.count("pd_held_sends", len(self._send_hold.settle(results.finished_sending,
                                                                    in_flight)))
        mismatched = self._verify_reads(results, meta, finished_req_ids, stats)
        stats.count("pd_recomputes" if self._recompute_failed_loads else "pd_failed_loads",
                    len(results.failed_recving) + mismatched)
        return results

    def _verify_reads(self, results: KVConnectorTransferResults, meta: Any,
                      finished_req_ids: set[str], stats: PdNixlStats) -> int:
        """Prefill: digest the prompts completed in this step's forward pass (pull). Decode:
        check the reads released this step (after their lease verdict) and the finished pushes
        (once their digests are in); returns the loads that failed their check (reported as
        invalid blocks, not failed receives)."""
        due = getattr(meta, "pd_digest_blocks", None)
        if due and self._digest_channel is not None:  # (None for each, where it cannot digest)
            self._digest_channel.send(self._block_verifier, due)
        if self._push_digests is not None:
            missing, dropped = self._push_digests.take_counts()
            stats.count("pd_missing_digests", missing)
            stats.count(FAULTS_INJECTED_KEY, dropped)
        verifier = self._load_verifier
        if verifier is None:
            return 0
        verifier.stats = stats
        verifier.forget(finished_req_ids)  # first: a held push whose request ended is released
        results.failed_recving |= verifier.settle(results.finished_recving,
                                                  results.failed_recving)
        return verifier.take_mismatched_reads()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        verifier = self._load_verifier
        if verifier is not None and self.has_connector_metadata():
            # upstream consumes the reads' metadata in its own calls: keep what a check needs
            meta = self._get_connector_metadata()
            verifier.expect(getattr(meta, "pd_expected_digests", None) or {})
            pushed = self.pd_mode == "push"
            for req_id, read in getattr(meta, "reqs_to_recv", {}).items():
                # a push's decode is not `awaiting_kvs` in upstream's sense (it waits all the same)
                if (not read.awaiting_kvs and not pushed) or read.remote is None:
                    continue
                local = group0(read.local_block_ids)
                peer_why = (f"the prefill has TP {read.tp_size}" if read.tp_size != 1
                            else None)
                # a push prefill digests the blocks it writes: as many as the decode's
                remote = len(local) if pushed else len(group0(read.remote.block_ids))
                verifier.remember(req_id, local, remote, read.remote.engine_id, peer_why,
                                  pushed=pushed)
        return super().start_load_kv(forward_context, **kwargs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid = super().get_block_ids_with_load_errors()
        if self._load_verifier is not None:
            invalid = set(invalid) | self._load_verifier.take_invalid()
        return invalid

    def _check_leases(self, results: KVConnectorTransferResults,
                      new_checks: dict[str, LeaseCheck | None],
                      finished_req_ids: set[str]) -> None:
        """Hold this step's finished reads until their prefill confirms its lease held."""
        guard, stats = self._late_read_guard, self.connector_worker.xfer_stats
        self._lease_checks.update(new_checks)
        for request_id in results.failed_recving:
            self._lease_checks.pop(request_id, None)
        for request_id in results.finished_recving - results.failed_recving:
            if request_id not in self._lease_checks:
                continue  # no remote read (e.g. rejected params)
            check = self._lease_checks.pop(request_id)
            if check is None:
                stats.count("pd_unchecked_reads")
                continue
            host, port, remote_request_id, ranks = check
            results.finished_recving.discard(request_id)
            guard.hold(request_id, (host, port), remote_request_id, ranks=ranks)
        for request_id in finished_req_ids:  # aborted before their read finished
            self._lease_checks.pop(request_id, None)
        verdicts = guard.poll()
        for request_id in verdicts.late:
            logger.error("PdNixlConnector: request %s read KV blocks its prefill had already "
                         "released (lease expired); the data is discarded and the load failed",
                         request_id)
        for request_id in verdicts.timed_out:
            logger.error("PdNixlConnector: no lease verdict for request %s's read; treated as "
                         "late", request_id)
        failed = verdicts.late | verdicts.timed_out
        results.finished_recving |= verdicts.on_time | failed
        results.failed_recving |= failed
        stats.count("pd_late_reads", len(verdicts.late))
        stats.count("pd_lease_check_timeouts", len(verdicts.timed_out))

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        self._experts.after_step()  # called once per step, after the forward pass
        lease = self._notif_tap.take_verdicts() if self._notif_tap is not None else None
        if self._load_verifier is not None:
            # the same type from every worker of the engine (vLLM aggregates them with the
            # first one's aggregate(): a LeaseVerdicts beside a PdNixlWorkerMeta lost one)
            return PdNixlWorkerMeta(lease=lease or LeaseVerdicts(),
                                    loads=self._load_verifier.take_outcomes())
        if self._notif_tap is not None:
            return lease
        return super().build_connector_worker_meta()

    def shutdown(self):
        self._experts.close()
        if self._digest_channel is not None:
            self._digest_channel.close()
        if self._lease_server is not None:
            self._lease_server.close()
        if self._late_read_guard is not None:
            self._late_read_guard.close()
        return super().shutdown()


class PdNixlPullConnector(_PdAdditions, NixlPullConnector):
    pd_mode: TransferMode = "pull"


class PdNixlPushConnector(_PdAdditions, NixlPushConnector):
    pd_mode: TransferMode = "push"


class PdNixlConnector(_PdStatsClassMethods, NixlBaseConnector):
    """The name users select; builds the pull or push variant from the config's `mode`."""

    def __new__(
        cls, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        variant = {"pull": PdNixlPullConnector, "push": PdNixlPushConnector}[
            transfer_mode_of(vllm_config)
        ]
        return variant(vllm_config, role, kv_cache_config)
