"""The pieces PdNixlConnector adds on top of upstream's NIXL connectors to stay correct under load.

- `NotifTap` (prefill, pull): sees every read-completion notification before upstream handles it
  and records whether the prefill still held the blocks; the verdicts go to the scheduler process
  (`LeaseVerdicts`, worker metadata) whose `LeaseCheckServer` answers decodes (transfer/lease_check).
- `PushDeadlines` (decode, push): a registered push that has not completed by its deadline is
  reported as a failed load, so `kv_load_failure_policy` decides and the blocks come back, instead
  of the request waiting forever; a completion that turns up later is dropped.
- `SendHold` (prefill, push): a lease that expires while a WRITE from its blocks is still in flight
  keeps the blocks until the WRITE ends (upstream frees them at once, and the WRITE could then
  copy another request's KV).
- `WriteGate` (prefill, push): no WRITE starts from blocks whose lease has run out, or into a
  decode that has stopped waiting (the decode's registration says until when it waits). Upstream
  starts deferred WRITEs whenever their handshake completes, which was seen 20 s after both.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.logger import init_logger

from pd_plugins.connectors.vllm.nixl_internals import holds_blocks, lease_end, replace_push_start
from pd_plugins.transfer.lease_check import VerdictTable, checkable

logger = init_logger(__name__)


@dataclass
class LeaseVerdicts(KVConnectorWorkerMetadata):
    """Worker -> scheduler: (prefill request id, reader agent, read finished while leased, the
    worker's TP rank); vLLM gathers every worker's into the scheduler's."""

    verdicts: list[tuple[str, str, bool, int]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, LeaseVerdicts):
            self.verdicts.extend(other.verdicts)
        return self

    def record_into(self, table: VerdictTable) -> None:
        for request_id, reader, on_time, rank in self.verdicts:
            table.record(request_id, reader, on_time, rank)


class NotifTap:
    """Wraps a worker's NIXL agent; classifies read-completion notifications as they are fetched.

    Upstream fetches notifications and, in the same call, frees the blocks of the requests they
    name; `is_leased(request_id)` is asked just before that, so it sees the lease as the read did.
    """

    def __init__(self, agent: Any, is_leased: Callable[[str], bool], rank: int = 0) -> None:
        self._agent = agent
        self._is_leased = is_leased
        self._rank = rank  # this worker's TP rank: a reader may read from several
        self._verdicts: list[tuple[str, str, bool, int]] = []

    def get_new_notifs(self, *args: Any, **kwargs: Any) -> dict[str, list[bytes]]:
        notifs = self._agent.get_new_notifs(*args, **kwargs)
        for reader, messages in notifs.items():
            for message in messages:
                # Completions are b"<request id>:<consumers>"; heartbeats are b"HB:...". An id
                # too long for a lease check to ask about is not kept (any NIXL peer can send
                # one: the table is bounded in entries, this bounds each entry).
                if message.startswith(b"HB:") or b":" not in message:
                    continue
                raw_id = message.rsplit(b":", 1)[0]
                if not checkable(raw_id, reader):
                    continue
                request_id = raw_id.decode("utf-8", "replace")
                self._verdicts.append((request_id, reader, self._is_leased(request_id),
                                       self._rank))
        return notifs

    def take_verdicts(self) -> LeaseVerdicts | None:
        if not self._verdicts:
            return None
        verdicts, self._verdicts = self._verdicts, []
        return LeaseVerdicts(verdicts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


class BoundedDict(OrderedDict):
    """An insertion-ordered dict of at most `size` entries: a new one pushes out the oldest (as a
    set: keys mapped to None)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size = size

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        while len(self) > self._size:
            self.popitem(last=False)


class PushDeadlines:
    """Decode side of push: request id -> when its push must have completed."""

    def __init__(self) -> None:
        self._deadlines: dict[str, float] = {}
        self._given_up = BoundedDict(10_000)  # ids of requests given up (values None)

    def expect(self, waits: dict[str, float], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for request_id, timeout_s in waits.items():
            self._deadlines[request_id] = now + timeout_s

    def settle(self, finished_recving: set[str], failed_recving: set[str],
               now: float | None = None) -> set[str]:
        """Apply deadlines to one step's results in place; returns the requests that timed out."""
        # Reports of requests already given up would reach the scheduler twice: drop them.
        late_reports = {r for r in finished_recving | failed_recving if r in self._given_up}
        finished_recving -= late_reports
        failed_recving -= late_reports
        for request_id in finished_recving | failed_recving:
            self._deadlines.pop(request_id, None)
        now = time.monotonic() if now is None else now
        timed_out = {r for r, deadline in self._deadlines.items() if now >= deadline}
        for request_id in timed_out:
            del self._deadlines[request_id]
            self._given_up[request_id] = None
        finished_recving |= timed_out
        failed_recving |= timed_out
        return timed_out

    def __len__(self) -> int:
        return len(self._deadlines)


class SendHold:
    """Prefill side of push: expired leases wait for their in-flight WRITEs before freeing."""

    def __init__(self, max_hold_s: float) -> None:
        self.max_hold_s = max_hold_s
        self._held: dict[str, float] = {}  # request id -> when the hold gives up

    def settle(self, finished_sending: set[str], in_flight: set[str],
               now: float | None = None) -> set[str]:
        """Apply to one step's finished_sending in place; returns the newly held requests."""
        now = time.monotonic() if now is None else now
        newly_held = finished_sending & in_flight
        for request_id in newly_held:
            self._held[request_id] = now + self.max_hold_s
        finished_sending -= newly_held
        released = {r for r, until in self._held.items()
                    if r not in in_flight or now >= until}
        for request_id in released:
            del self._held[request_id]
        finished_sending |= released
        return newly_held


WRITE_BY_KEY = "pd_write_by"  # in a push registration: wall-clock time after which the decode
                              # no longer waits (set by the decode, honoured by the prefill)


class WriteGate:
    """Wraps a push worker's WRITE start (run on its writer thread; nixl_internals.py).

    A WRITE starts only while the prefill still leases the blocks (its lease deadline, not only
    the reaping, which a stalled engine step can delay) and before the decode's write-by time.
    `lock` is held around the start and around upstream's lease reaping, so a WRITE either starts
    (and is in flight, see SendHold) before its lease is reaped, or not at all. `before_write`
    (the WRITE's digests, pd_nixl_verify.PushDigestSender) runs just before an allowed start
    and may skip it (a fault).
    """

    def __init__(self, worker: Any) -> None:
        self.lock = threading.Lock()
        self._worker = worker
        self._start_write = replace_push_start(worker, self._guarded_start)
        self._refused = 0
        self.before_write: Callable[[str, Any, dict[str, Any]], bool] | None = None

    def _guarded_start(self, request_id: str, local_block_ids: Any,
                       registration: dict[str, Any]) -> None:
        with self.lock:
            why = self._refusal(request_id, registration)
            if why is None:
                hook = self.before_write
                if hook is None or hook(request_id, local_block_ids, registration):
                    self._start_write(request_id, local_block_ids, registration)
                return
            self._refused += 1
        logger.warning("PdNixlConnector: no WRITE for request %s: %s", request_id, why)

    def _refusal(self, request_id: str, registration: dict[str, Any]) -> str | None:
        write_by = registration.get(WRITE_BY_KEY)
        if isinstance(write_by, (int, float)) and time.time() > write_by:
            return "the decode has stopped waiting for it"
        if not holds_blocks(self._worker, request_id):
            return "its blocks were released"
        lease_ends = lease_end(self._worker, request_id)
        if lease_ends is not None and time.perf_counter() >= lease_ends:
            return "its lease has run out"
        return None

    def take_refused(self) -> int:
        refused, self._refused = self._refused, 0
        return refused
