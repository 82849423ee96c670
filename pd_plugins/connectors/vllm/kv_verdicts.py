"""Verified KV loads in vLLM (issue 28): the counters every transport shares, each step's load
outcomes from the workers to the scheduler, and the verdict the scheduler puts into the answer
(`pd.kv`, vocab/transfer_params.KvVerdict) and counts.

The worker knows what a load found (blocks that matched their producer's digest, did not, or
could not be loaded); the scheduler knows how the request ended. vLLM hands the workers' metadata
to the scheduler at the end of the step's `update_from_output`, after requests that finished in
that step were released (scheduler.py, `_update_from_kv_xfer_finished`). So a request that
finishes in the very step that loaded its KV is answered before its outcome arrives. That is
exact all the same: vLLM skips, in that step, every request with a block it was told failed to
load (`_handle_invalid_blocks`: rescheduled to recompute, or ended in error under policy `fail`),
so a request that finishes normally in its load step loaded every block, and its verdict is the
clean one (`verified` if the transport checked, else `unverified`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import get_args

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from pd_plugins.connectors.vllm.counter_stats import CounterTable
from pd_plugins.vocab.engines import TransferMode
from pd_plugins.vocab.transfer_params import (KV_FAULTS_INJECTED_METRIC, KV_MISMATCHED_REQUESTS_METRIC,
                                              KvVerdict, KvVerdictWord)

FAULTS_INJECTED_KEY = "kv_faults_injected"
VERDICT_WORDS: tuple[str, ...] = get_args(KvVerdictWord)
MAX_PENDING = 65536  # requests with a load not yet finished; more are forgotten, oldest first


def verdict_key(word: str) -> str:
    return f"kv_verdicts_{word}"


# Merged into a verifying transport's counters (pd_shm_stats.py, pd_nixl_stats.py); vLLM adds
# `_total`.
KV_VERIFY_COUNTERS: CounterTable = {
    "kv_verified_blocks": (
        "vllm:pd_kv_verified_blocks",
        "KV blocks loaded whose bytes matched the digest their producer stated."),
    "kv_mismatched_blocks": (
        "vllm:pd_kv_mismatched_blocks",
        "KV blocks whose bytes did not match the digest their producer stated: never used "
        "(recomputed or failed per kv_load_failure_policy)."),
    "kv_mismatched_requests": (
        KV_MISMATCHED_REQUESTS_METRIC.removesuffix("_total"),  # pd-router's rotation watches it
        "KV loads (one per request and load) with at least one mismatched block."),
    "kv_unverified_loads": (
        "vllm:pd_kv_unverified_loads",
        "KV loads with nothing to check the bytes against (a pool without checksums, a NIXL "
        "read without digests or in a layout that cannot be checked)."),
    "kv_digest_seconds": (
        "vllm:pd_kv_digest_seconds",
        "Time spent computing KV digests, producer (stating them) and consumer (checking them) "
        "alike: what verification costs this engine."),
    "kv_digested_bytes": (
        "vllm:pd_kv_digested_bytes",
        "KV bytes digested (see vllm:pd_kv_digest_seconds)."),
    FAULTS_INJECTED_KEY: (
        KV_FAULTS_INJECTED_METRIC.removesuffix("_total"),  # pd-router warns when it rises
        "KV faults this engine injected (the `faults` option, for tests; 0 otherwise)."),
    **{verdict_key(word): (f"vllm:pd_kv_verdicts_{word}",
                           f"Requests whose loaded KV got the verdict `{word}` (pd.kv).")
       for word in VERDICT_WORDS},
}


@dataclass
class LoadOutcome:
    """What one worker's load for one request found."""

    blocks: int      # blocks the load was for
    failed: int      # of those, blocks not used (gone, torn, or mismatched)
    mismatched: int  # of the failed, blocks whose bytes did not match their digest
    checked: bool    # the bytes were checked against a producer's digest

    def merge(self, other: LoadOutcome) -> LoadOutcome:
        """Two loads of one request (ranks, or a load again after preemption): worst wins."""
        return LoadOutcome(max(self.blocks, other.blocks), max(self.failed, other.failed),
                           max(self.mismatched, other.mismatched),
                           self.checked and other.checked)


@dataclass
class KvLoadOutcomes(KVConnectorWorkerMetadata):
    """Worker -> scheduler: this step's load outcomes, by request id."""

    outcomes: dict[str, LoadOutcome] = field(default_factory=dict)

    def record(self, req_id: str, outcome: LoadOutcome) -> None:
        mine = self.outcomes.get(req_id)
        self.outcomes[req_id] = outcome if mine is None else mine.merge(outcome)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvLoadOutcomes):
            for req_id, outcome in other.outcomes.items():
                self.record(req_id, outcome)
        return self


def count_digest_cost(stats, verifier) -> None:
    """Count what a BlockVerifier (or None) spent since the last call on a stats object whose
    table has KV_VERIFY_COUNTERS."""
    if verifier is not None:
        seconds, nbytes = verifier.take_cost()
        stats.count("kv_digest_seconds", seconds)
        stats.count("kv_digested_bytes", nbytes)


def count_outcome(stats, outcome: LoadOutcome) -> None:
    """Count one load on a stats object whose table has KV_VERIFY_COUNTERS."""
    if outcome.checked:
        stats.count("kv_verified_blocks", outcome.blocks - outcome.failed)
        stats.count("kv_mismatched_blocks", outcome.mismatched)
        stats.count("kv_mismatched_requests", 1 if outcome.mismatched else 0)
    else:
        stats.count("kv_unverified_loads")


class VerdictBook:
    """Scheduler side: the requests with a load in flight, and their verdicts when they end."""

    def __init__(self, transport: TransferMode, recompute: bool) -> None:
        self.transport = transport
        self.recompute = recompute  # kv_load_failure_policy
        # req id -> (the clean outcome of its load, the outcome reported so far or None)
        self._pending: OrderedDict[str, tuple[LoadOutcome, LoadOutcome | None]] = OrderedDict()

    def expect(self, req_id: str, blocks: int, checked: bool) -> None:
        """A load of `blocks` blocks was handed to the workers (`checked`: they will check it)."""
        clean = LoadOutcome(blocks, 0, 0, checked)
        old = self._pending.pop(req_id, None)
        self._pending[req_id] = (clean if old is None else old[0].merge(clean),
                                 None if old is None else old[1])
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def record(self, meta: object) -> None:
        """The workers' outcomes of a step (any other metadata is ignored)."""
        if not isinstance(meta, KvLoadOutcomes):
            return
        for req_id, outcome in meta.outcomes.items():
            entry = self._pending.get(req_id)
            if entry is not None:
                seen = entry[1]
                self._pending[req_id] = (entry[0], outcome if seen is None else seen.merge(outcome))

    def drop(self, req_id: str) -> None:
        """Forget a request that ends unanswered (aborted): no verdict, not counted."""
        self._pending.pop(req_id, None)

    def verdict(self, req_id: str, errored: bool) -> KvVerdict | None:
        """The verdict of a finishing request (None: it loaded nothing); forgets it."""
        entry = self._pending.pop(req_id, None)
        if entry is None:
            return None
        clean, seen = entry
        outcome = seen or clean  # not reported yet: it finished in its load step (module doc)
        if outcome.failed:
            word = "recomputed" if self.recompute and not errored else "failed"
        elif errored:
            word = "failed"
        else:
            word = "verified" if outcome.checked else "unverified"
        return KvVerdict(verdict=word, blocks=outcome.blocks, mismatched=outcome.mismatched,
                         transport=self.transport)
