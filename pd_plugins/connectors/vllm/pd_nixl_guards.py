"""The pieces PdNixlConnector adds on top of upstream's NIXL connectors to stay correct under load.

- `NotifFilter` (every worker, pull and push): drops and counts the NIXL notifications upstream's
  parser cannot take (any NIXL peer can send any bytes; upstream parses them on the engine's main
  thread, where an exception ends the engine).
- `NotifTap` (prefill, pull): a NotifFilter that also sees every read-completion notification
  before upstream handles it and records whether the prefill still held the blocks; the verdicts go
  to the scheduler process (`LeaseVerdicts`, worker metadata) whose `LeaseCheckServer` answers
  decodes (transfer/lease_check).
- `PushDeadlines` (decode, push): a registered push that has not completed by its deadline is
  reported as a failed load, so `kv_load_failure_policy` decides and the blocks come back, instead
  of the request waiting forever; a completion that turns up later is dropped.
- `SendHold` (prefill, push): a lease that expires while a WRITE from its blocks is still in flight
  keeps the blocks until the WRITE ends or its decode stops waiting for it (upstream frees them at
  once, and the WRITE could then copy another request's KV).
- `ReadStarts` (decode, pull): a read whose start raises (upstream asserts on block lists shorter
  than the decode's allocation, numpy on ids past int32) or names blocks past the prefill's KV cache
  is a failed load, not an exception on the engine's main thread (which ended the engine).
- `WriteGate` (prefill, push): no WRITE starts from blocks whose lease has run out, or into a
  decode that has stopped waiting (the decode's registration says until when it waits). Upstream
  starts deferred WRITEs whenever their handshake completes, which was seen 20 s after both.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.logger import init_logger

from pd_plugins.connectors.vllm.nixl_internals import (
    fail_receive,
    forget_receive,
    holds_blocks,
    lease_end,
    remote_logical_blocks,
    replace_push_start,
    replace_read_start,
)
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


HEARTBEAT_PREFIX = b"HB:"
PUSH_REG_PREFIX = b"PUSH_REG:"  # upstream's metadata.PUSH_REG_NOTIF_PREFIX (push only)
DIGESTS_PREFIX = b"PDKVD:"  # pd_nixl_verify.PUSH_DIGESTS_PREFIX, taken out by its DigestInbox
LOGGED_DROPS = 10  # dropped notifications logged per worker (any NIXL peer can send many)


def completion_count(message: bytes) -> int | None:
    """The count of a completion notification b"<utf-8 request id>:<decimal count>" (what
    upstream 0.32 sends after a READ or WRITE), or None if `message` is not one."""
    head, sep, tail = message.rpartition(b":")
    if not sep or not head or not tail.isdigit() or len(tail) > 9:  # bytes.isdigit: ASCII only
        return None
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return int(tail)


class NotifFilter:
    """Wraps a worker's NIXL agent; passes on only notifications upstream 0.32 can parse.

    Upstream sends and parses (pull_worker/push_worker `_get_new_notifs`, on the engine's main
    thread, no try/except): heartbeats b"HB:<ids>" and completions b"<request id>:<count>", both
    decoded as UTF-8, the count by int(); push registrations b"PUSH_REG:" + msgpack (push only,
    parsed on the writer thread, which logs its own errors). Anything else a NIXL peer sends
    (b"junk", bytes that are not UTF-8, a count that is not a number, a digest notification
    nobody below took) raised there and ended the engine: it is dropped and counted
    (`take_dropped`, /metrics `vllm:pd_nixl_dropped_notifs`). A completion's count must be at
    least 1; on a push prefill (`tp_size` given) it must divide or be a multiple of the worker's
    TP size, as upstream's TransferTopology.tp_ratio asserts.

    `get_new_notifs` runs on whichever thread fetches (push: upstream's writer thread).
    """

    def __init__(self, agent: Any, push: bool = False,
                 tp_size: Callable[[], int | None] | None = None) -> None:
        self._agent = agent
        self._push = push
        self._tp_size = tp_size
        self._dropped = 0
        self._logged = 0  # dropped ones logged (the first LOGGED_DROPS; then only counted)
        self._dropped_lock = threading.Lock()

    def why_dropped(self, message: Any) -> str | None:
        """Why upstream cannot take `message` (None: it can)."""
        if not isinstance(message, bytes):
            return "not bytes"
        if message.startswith(PUSH_REG_PREFIX):
            return None if self._push else "a push registration on a pull engine"
        if message.startswith(DIGESTS_PREFIX):
            return "KV digests this engine does not take"
        if message.startswith(HEARTBEAT_PREFIX):
            try:
                message.decode("utf-8")
            except UnicodeDecodeError:
                return "a heartbeat that is not UTF-8"
            return None
        count = completion_count(message)
        if count is None:
            return "neither a heartbeat nor b'<request id>:<count>'"
        if count < 1:
            return "a completion count below 1"
        tp = self._tp_size() if self._tp_size is not None else None
        if tp and count % tp and tp % count:
            return f"a completion count {count} that does not pair with TP {tp}"
        return None

    def get_new_notifs(self, *args: Any, **kwargs: Any) -> dict[str, list[bytes]]:
        notifs = self._agent.get_new_notifs(*args, **kwargs)
        passed: dict[str, list[bytes]] = {}
        dropped = 0
        for peer, messages in notifs.items():
            kept = []
            for message in messages:
                why = self.why_dropped(message)
                if why is None:
                    kept.append(message)
                    self._saw(peer, message)
                    continue
                dropped += 1
                if self._logged < LOGGED_DROPS:
                    self._logged += 1
                    logger.warning("PdNixlConnector: dropped a NIXL notification from agent "
                                   "%.200s (%s; %d bytes)%s", peer, why,
                                   len(message) if isinstance(message, bytes) else -1,
                                   "; further ones are only counted"
                                   if self._logged == LOGGED_DROPS else "")
            passed[peer] = kept
        if dropped:
            with self._dropped_lock:
                self._dropped += dropped
        return passed

    def _saw(self, peer: str, message: bytes) -> None:
        """A notification passed on to upstream (for subclasses)."""

    def take_dropped(self) -> int:
        with self._dropped_lock:
            dropped, self._dropped = self._dropped, 0
        return dropped

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


class NotifTap(NotifFilter):
    """Wraps a pull prefill worker's NIXL agent; passes on only what upstream can parse
    (NotifFilter) and classifies read-completion notifications as they are fetched.

    Upstream fetches notifications and, in the same call, frees the blocks of the requests they
    name; `is_leased(request_id)` is asked just before that, so it sees the lease as the read did.
    """

    def __init__(self, agent: Any, is_leased: Callable[[str], bool], rank: int = 0) -> None:
        super().__init__(agent)
        self._is_leased = is_leased
        self._rank = rank  # this worker's TP rank: a reader may read from several
        self._verdicts: list[tuple[str, str, bool, int]] = []

    def _saw(self, reader: str, message: bytes) -> None:
        # Completions are b"<request id>:<consumers>"; heartbeats are b"HB:...". An id too long
        # for a lease check to ask about is not kept (any NIXL peer can send one: the table is
        # bounded in entries, this bounds each entry).
        if message.startswith(HEARTBEAT_PREFIX):
            return
        raw_id = message.rsplit(b":", 1)[0]
        if not checkable(raw_id, reader):
            return
        request_id = raw_id.decode("utf-8")
        self._verdicts.append((request_id, reader, self._is_leased(request_id), self._rank))

    def take_verdicts(self) -> LeaseVerdicts | None:
        if not self._verdicts:
            return None
        verdicts, self._verdicts = self._verdicts, []
        return LeaseVerdicts(verdicts)


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
    """Decode side of push: request id -> when its push must have completed.

    A push given up on is forgotten by upstream's worker too (`worker`: nixl_internals.
    forget_receive), so its state does not stay forever (a prefill that never writes) and a
    completion that comes later is not reported again: the scheduler asserts on a receive it no
    longer waits for, which ended the engine. `_given_up` drops the ones upstream has already
    counted when the deadline passes (bounded: it is the second line, not the first)."""

    def __init__(self, worker: Any = None) -> None:
        self._worker = worker
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
            if self._worker is not None:
                forget_receive(self._worker, request_id)
        finished_recving |= timed_out
        failed_recving |= timed_out
        return timed_out

    def __len__(self) -> int:
        return len(self._deadlines)


# A prefill starts no WRITE later than this before the decode gives up (the WRITE must land in it).
WRITE_MARGIN_S = 5.0
MAX_HOLD_S = 3600.0  # the longest a push decode waits (push_timeout_s's bound): a hold's bound


class SendHold:
    """Prefill side of push: expired leases wait for their in-flight WRITEs before freeing.

    A hold lasts until the WRITE ends, or until its decode stops waiting for it (the write-by time
    in its registration + WRITE_MARGIN_S: after that nothing reads what the WRITE copies), at
    least `max_hold_s` (the lease) and at most MAX_HOLD_S (a decode's clock or value is a peer's).
    A decode that states no write-by time (not PdNixlConnector) waits as long as it likes: its
    hold is `max_hold_s`. `decode_deadline(request_id)`: the write-by time of the request's WRITE
    (WriteGate.decode_deadline), or None."""

    def __init__(self, max_hold_s: float,
                 decode_deadline: Callable[[str], float | None] | None = None) -> None:
        self.max_hold_s = max_hold_s
        self._decode_deadline = decode_deadline
        self._held: dict[str, float] = {}  # request id -> when the hold gives up

    def hold_s(self, request_id: str) -> float:
        """How long an expired lease with a WRITE in flight is held at most, from now."""
        write_by = self._decode_deadline(request_id) if self._decode_deadline else None
        if write_by is None:
            return self.max_hold_s
        waits_s = write_by + WRITE_MARGIN_S - time.time()
        return min(MAX_HOLD_S, max(self.max_hold_s, waits_s))

    def settle(self, finished_sending: set[str], in_flight: set[str],
               now: float | None = None) -> set[str]:
        """Apply to one step's finished_sending in place; returns the newly held requests."""
        now = time.monotonic() if now is None else now
        newly_held = finished_sending & in_flight
        for request_id in newly_held:
            self._held[request_id] = now + self.hold_s(request_id)
        finished_sending -= newly_held
        released = {r for r, until in self._held.items()
                    if r not in in_flight or now >= until}
        for request_id in released:
            del self._held[request_id]
        finished_sending |= released
        return newly_held


def block_ids_past(block_ids: Any, limit: int) -> int | None:
    """The largest of `block_ids` (a flat list, or one list per group) if it is `limit` or more."""
    top = max((b for entry in block_ids or ()
               for b in (entry if isinstance(entry, (list, tuple)) else (entry,))), default=-1)
    return top if top >= limit else None


class ReadStarts:
    """Wraps a pull decode worker's read start (upstream's `_read_blocks_for_req`, called on the
    engine's main thread by start_load_kv, also once a handshake is done): a read that cannot
    start is reported as a failed load (upstream's own failure path, so vLLM's
    kv_load_failure_policy applies) instead of raising into the engine."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self._start_read = replace_read_start(worker, self._guarded_start)
        self._failed = 0

    def _guarded_start(self, request_id: str, meta: Any) -> None:
        try:
            why = self._refusal(meta)
            if why is None:
                self._start_read(request_id, meta)
                return
            logger.error("PdNixlConnector: request %s's read cannot start: %s; its KV load "
                         "failed", request_id, why)
        except Exception:  # noqa: BLE001 - a request's params must not end the engine
            logger.exception("PdNixlConnector: starting request %s's read raised; its KV load "
                             "failed", request_id)
        fail_receive(self._worker, request_id)
        self._failed += 1

    def _refusal(self, meta: Any) -> str | None:
        remote = meta.remote
        if remote is None:
            return None
        limit = remote_logical_blocks(self._worker, remote.engine_id)
        past = block_ids_past(remote.block_ids, limit) if limit is not None else None
        if past is not None:
            return (f"kv_transfer_params.remote_block_ids names block {past}, the prefill has "
                    f"{limit} KV blocks")
        return None

    def take_failed(self) -> int:
        failed, self._failed = self._failed, 0
        return failed


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
        self._write_by = BoundedDict(65_536)  # request id -> its started WRITE's decode write-by
        self._write_by_lock = threading.Lock()  # written on the writer thread, read on the main

    def _guarded_start(self, request_id: str, local_block_ids: Any,
                       registration: dict[str, Any]) -> None:
        with self.lock:
            why = self._refusal(request_id, registration)
            if why is None:
                hook = self.before_write
                if hook is None or hook(request_id, local_block_ids, registration):
                    self._remember_write_by(request_id, registration.get(WRITE_BY_KEY))
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

    def _remember_write_by(self, request_id: str, write_by: Any) -> None:
        if isinstance(write_by, (int, float)) and math.isfinite(write_by):
            with self._write_by_lock:
                self._write_by[request_id] = float(write_by)

    def decode_deadline(self, request_id: str) -> float | None:
        """The write-by time (wall clock) the decode stated for the request's WRITE, if any."""
        with self._write_by_lock:
            return self._write_by.get(request_id)

    def take_refused(self) -> int:
        refused, self._refused = self._refused, 0
        return refused
