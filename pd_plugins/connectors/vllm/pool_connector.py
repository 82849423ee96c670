"""What PdShmConnector and PdLMCacheConnector share: a connector to a KV pool whose loads are
synchronous copies before the forward pass, split into a scheduler-side object (lookups, what
to load and store each step, the prefill's answer) and a worker-side object (the copies).

A subclass sets `STATS` and `PROM_METRICS` (its counters, counter_stats.py) and creates
`self._scheduler` / `self._worker` for its role; vLLM's calls are routed to them here. Its
scheduler side derives from `PoolSchedulerSide` (pool_scheduler.py: request tracking, the
last-token rule, what to store, the prefill's answer), its worker side from `PoolWorkerSide`,
which keeps the step's failed loads, counters and load outcomes (kv_verdicts.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.logger import init_logger

from pd_plugins.connectors.transfer_params import malformed_params_error
from pd_plugins.connectors.vllm.counter_stats import (
    REJECTED_PARAMS_KEY,
    CounterPromMetrics,
    CounterStats,
)
from pd_plugins.connectors.vllm.kv_layout import refuse_state_space_models
from pd_plugins.connectors.vllm.kv_verdicts import (
    KvLoadOutcomes,
    LoadOutcome,
    count_digest_cost,
    count_outcome,
)
from pd_plugins.connectors.vllm.options import extra_options

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


def engine_rank_groups(parallel_config: Any) -> list[Any]:
    """The CPU process groups over which an engine's ranks share a step's failed loads
    (PoolWorkerSide.share_failed_loads): vLLM's TP group (gloo, set up before the KV
    connector's worker side); none for one rank. Not the PP group: a later stage waits in its
    receive for the earlier one's forward pass, which ends after both connector hooks, so a
    collective between stages in either hook would deadlock (SyncPoolConnector warns)."""
    if parallel_config.tensor_parallel_size == 1:
        return []
    from vllm.distributed.parallel_state import get_tp_group

    return [get_tp_group().cpu_group]


class PoolWorkerSide:
    """A worker side's failed block loads, counters and load outcomes, handed to vLLM once
    each."""

    STATS: type[CounterStats] = CounterStats

    def __init__(self) -> None:
        self._invalid: set[int] = set()
        self._failed_now: dict[str, set[int]] = {}  # this step's failed load blocks, by request
        self._outcomes = KvLoadOutcomes()
        self.stats = self.STATS()
        self.verifier: Any = None  # a BlockVerifier where the transport digests blocks (LMCache)

    def fail_blocks(self, req_id: str, block_ids: Iterable[int]) -> None:
        """Blocks of a load that vLLM must not use (it recomputes or fails them)."""
        self._invalid.update(block_ids)
        self._failed_now.setdefault(req_id, set()).update(block_ids)

    def own_blocks(self, req_id: str, block_ids: Sequence[int]) -> int:
        """How many of a store's leading blocks (prompt order) hold the request's own KV this
        step: not a block whose load failed (stale bytes, or damaged ones), nor any after it
        (this step computed those from it). Storing them would put KV under the prompt's key
        that is not its KV, with fresh checksums and digests: every later reader 'verified'.
        Any request's failed load counts: vLLM lets a request of the same step share a block
        another one is loading (its prefix cache), and rewinds both."""
        if not self._failed_now:
            return len(block_ids)
        failed = set().union(*self._failed_now.values())
        first = next((i for i, b in enumerate(block_ids) if b in failed), None)
        if first is not None:
            return first
        return 0 if req_id in self._failed_now else len(block_ids)

    def share_failed_loads(self, groups: Sequence[Any]) -> None:
        """An engine of several ranks: every rank's failed loads of the step, so that each
        rank's stores stop where any rank's load failed. A rank whose own slots loaded fine
        still computes its later blocks from the other ranks' (each layer's all-reduce mixes
        the heads), so its own loads alone do not say which of its blocks are the prompt's KV.
        `groups`: engine_rank_groups' process groups, every rank in them calling in the same
        step."""
        for group in groups:
            gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(gathered, self._failed_now, group=group)
            merged: dict[str, set[int]] = {}
            for failed in gathered:
                for req_id, block_ids in failed.items():
                    merged.setdefault(req_id, set()).update(block_ids)
            self._failed_now = merged

    def end_step(self) -> None:
        self._failed_now.clear()

    def take_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def record_load(self, req_id: str, outcome: LoadOutcome) -> None:
        """A checked transport's load: counted (kv_verdicts.KV_VERIFY_COUNTERS) and reported to
        the scheduler, which puts the request's verdict into its answer."""
        self._outcomes.record(req_id, outcome)
        count_outcome(self.stats, outcome)

    def take_outcomes(self) -> KvLoadOutcomes | None:
        if not self._outcomes.outcomes:
            return None
        out, self._outcomes = self._outcomes, KvLoadOutcomes()
        return out

    def take_stats(self) -> CounterStats | None:
        count_digest_cost(self.stats, self.verifier)
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, self.STATS()
        return out


class SyncPoolConnector(KVConnectorBase_V1):
    STATS: type[CounterStats] = CounterStats
    PROM_METRICS: type[CounterPromMetrics] = CounterPromMetrics
    OPTIONS: type = msgspec.Struct  # the transport's options struct (pd_plugins/transfer/options.py)
    _scheduler: Any = None  # a PoolSchedulerSide (pool_scheduler.py) in the scheduler process
    _worker: Any = None
    _scheduler_stats: CounterStats | None = None  # scheduler side: not yet on /metrics

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        config = vllm_config.kv_transfer_config
        self.kv_cache_config = kv_cache_config
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = config.engine_id
        self.stores = config.kv_role in ("kv_producer", "kv_both")  # this engine fills the pool
        self.failure_policy = config.kv_load_failure_policy  # "recompute" or "fail"
        self.options = extra_options(self.OPTIONS, config, type(self).__name__)
        self.parallel_config = vllm_config.parallel_config
        self._rank_groups: list[Any] | None = None  # worker side, at its first load
        if self.stores and self.parallel_config.pipeline_parallel_size > 1:
            logger.warning("%s: with pipeline parallelism a stage does not learn of an earlier "
                           "stage's failed pool loads (no collective between stages within a "
                           "step), so after one it may store blocks computed from the stale "
                           "KV; the TP ranks of one stage do agree", type(self).__name__)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # The earliest call a connector gets with the model's config: vLLM's engine core asks it
        # before it sizes the KV cache, and so before its own opaque failure for a state-space
        # model without the hybrid allocator. No layout preference otherwise.
        refuse_state_space_models(vllm_config, cls.__name__)
        return None

    @property
    def kv_cache_manager(self):
        return self._kv_cache_manager

    # -- stats -------------------------------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> CounterStats:
        return cls.STATS(data=data) if data is not None else cls.STATS()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return cls.PROM_METRICS(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> CounterStats | None:
        if self._worker:
            return self._worker.take_stats()
        stats, self._scheduler_stats = self._scheduler_stats, None
        return stats

    def count_on_scheduler(self, key: str, n: float = 1) -> None:
        """Count a scheduler-side event; vLLM collects it with the step's worker counters."""
        if self._scheduler_stats is None:
            self._scheduler_stats = self.STATS()
        self._scheduler_stats.count(key, n)

    # -- scheduler side ----------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        # The first connector call for a request: what a client put there is checked once here.
        error = malformed_params_error(request.kv_transfer_params)
        if error is not None:
            logger.warning("%s: request %s: %s; ignored, served without remote KV",
                           type(self).__name__, request.request_id, error)
            request.kv_transfer_params = None
            self.count_on_scheduler(REJECTED_PARAMS_KEY)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)
        super().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # stores finish inside the step (wait_for_save): the blocks can be freed at once
        return False, self._scheduler.request_finished(request)

    # -- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self._worker.start_load_kv(meta)
        # An engine of several ranks that stores: its ranks agree on the step's failed loads
        # before the forward pass. Every rank gets the same metadata, so all of them take part
        # in a step with loads, or none does.
        if self.stores and meta.has_loads:
            if self._rank_groups is None:
                self._rank_groups = engine_rank_groups(self.parallel_config)
            if self._rank_groups:
                self._worker.share_failed_loads(self._rank_groups)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous (start_load_kv copies before the forward pass)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_outcomes()
