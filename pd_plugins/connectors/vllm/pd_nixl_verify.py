"""Verified NIXL pull reads (issue 28; docs/plans/kv-verification.md §4.1), PdNixlConnector's part.

Producer (prefill): the scheduler marks the step in which a PD prefill leg's prompt completes
(`DigestPlan`); after that step's forward pass the worker digests the request's blocks
(block_verifier.py, ws64) and pushes them to its scheduler over the signature channel (purpose
"kv-digests"; vLLM's own worker metadata would arrive after the request is answered), which puts
them into the `pd` section of the prefill's answer (`kv_digest`).

Consumer (decode): the scheduler ships each read's expected digests to the workers with the read
(`expected_digests`, a peer's value: checked, bounded; unusable ones make the read `unverified`).
When a read is finished, not failed and (where checked) on time by its lease, the worker
(`LoadVerifier`) digests the blocks it read and compares them with the tail of the prefill's list
(a decode with a local prefix hit reads only its suffix, block_verifier.paired_expected). A
mismatch at block k makes blocks k.. invalid (vLLM's `get_block_ids_with_load_errors`): vLLM
recomputes them (kv_load_failure_policy `recompute`) or fails the request (`fail`). Each read's
outcome goes to the scheduler as worker metadata (`PdNixlWorkerMeta`), which puts the request's
verdict into its answer (`pd.kv`, kv_verdicts.VerdictBook).

Push (§4.2): the prefill digests the blocks a WRITE is about to copy, just before it starts
(`PushDigestSender`, on upstream's writer thread, through pd_nixl_guards.WriteGate), and sends them
to the decode's NIXL agent as a notification (`PDKVD:` + msgpack [decode request id, rank,
encoded]), once per request, once the handshake named the agent, and only to a decode whose push
registration asks for them (`ACCEPTS_DIGESTS_KEY`): upstream's parser raises on one and ends the
engine. The decode's `DigestInbox` takes those notifications out of what upstream fetches
(upstream parses every other one as "<request id>:<count>"; a push decode without an inbox drops
them, pd_nixl_guards.NotifFilter), and gives a push only digests its prefill's NIXL agents sent.
A finished push is checked as a pull read is; its digests may arrive after the WRITE's own
completion notification (NIXL does not order the two), so the push is held until they do, or
`PUSH_DIGEST_WAIT_S` (then `unverified`, or failed under `required`).

Only equal layouts can be checked (one KV cache group, TP 1 on both ends, equal block sizes, no
upstream post-processing: nixl_internals.unverifiable_layout); any other read is `unverified`
(or failed under `verify_kv: required`), never `verified`.
Fault injection (decode, before the check): `corrupt` damages one byte of one block a targeted load
landed, `reuse` overwrites one with another block's bytes; (push prefill) `drop_write` sends the
digests and the WRITE's completion notification without the WRITE.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Collection

import msgspec
import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.logger import init_logger

from pd_plugins.connectors.vllm.block_verifier import BlockVerifier, first_mismatch, paired_expected
from pd_plugins.connectors.vllm.kv_verdicts import (
    FAULTS_INJECTED_KEY,
    KvLoadOutcomes,
    LoadOutcome,
    count_outcome,
)
from pd_plugins.connectors.vllm.nixl_internals import remote_agent
from pd_plugins.connectors.vllm.pd_nixl_guards import DIGESTS_PREFIX, BoundedDict, LeaseVerdicts
from pd_plugins.transfer import kv_digest
from pd_plugins.transfer.kv_faults import KvFaults, position
from pd_plugins.transfer.signature_channel import (
    ResultReceiver,
    ResultSender,
    channel_address,
)
from pd_plugins.vocab.transfer_params import PD_SECTION_KEY, KvDigest

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = init_logger(__name__)

PURPOSE = "kv-digests"
MAX_TRACKED = 65536  # requests remembered between steps (oldest forgotten first)
PUSH_DIGESTS_PREFIX = DIGESTS_PREFIX  # b"PDKVD:"
MAX_PUSH_DIGESTS_BYTES = 1 << 21  # one notification: ~11 bytes (base64) a block, 128 k tokens fit
MAX_INBOX_BYTES = 64 << 20  # digests kept for pushes not yet checked (oldest forgotten first)
PUSH_DIGEST_WAIT_S = 2.0  # a finished push waits this long for its digests
# A finished pull prefill waits this long for the digests its worker was asked for (DigestPlan),
# on the engine's scheduler thread: they leave the worker after its forward pass, before the
# step's output, but a loaded host can hold ZMQ's I/O threads past 50 ms (test_kv_verify_nixl saw
# it). The worker answers every request it was asked about, with None where it cannot digest, so
# only a lost message costs the wait, once: after a wait runs out, none is waited for during the
# next DIGEST_WAIT_S (the other prefills of a lost step would each wait it out in turn).
DIGEST_WAIT_S = 0.5
_NONE_CAME = object()
# in a push registration: the decode takes PDKVD notifications out before upstream parses them
# and checks the blocks against them (set by a PdNixl decode with verify_kv on; a prefill sends
# digests to no other decode: upstream's parser raised on them and ended that decode's engine)
ACCEPTS_DIGESTS_KEY = "pd_accepts_digests"


def group0(block_ids: Any) -> list[int]:
    """KV cache group 0's block ids of upstream's BlockIds (per-group lists, or one flat list)."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return list(block_ids[0])
    return list(block_ids or ())


def prompt_completes(request: Request, scheduled: int) -> bool:
    """Whether the step that computes `scheduled` more tokens of `request` completes its prompt
    (num_computed_tokens does not yet include the step's tokens)."""
    return scheduled > 0 and request.num_computed_tokens + scheduled >= request.num_prompt_tokens


# -- producer ---------------------------------------------------------------------------------------
class DigestPlan:
    """Prefill scheduler side: the PD prefill legs whose prompt is not yet complete, and those
    whose worker has been asked for their digests."""

    def __init__(self) -> None:
        self._legs: BoundedDict = BoundedDict(MAX_TRACKED)  # req id -> Request
        self._asked: BoundedDict = BoundedDict(MAX_TRACKED)  # req ids (a set: values None)

    def track(self, request: Request) -> None:
        self._legs[request.request_id] = request

    def forget(self, req_id: str) -> bool:
        """Out of the plan; True if its worker was asked for its digests (they are coming)."""
        self._legs.pop(req_id, None)
        return self._asked.pop(req_id, False) is None

    def due(self, num_scheduled_tokens: dict[str, int],
            block_ids_of: Callable[[str], list[int]]) -> dict[str, list[int]]:
        """The legs whose prompt completes in this step, with their blocks (group 0)."""
        due = {}
        for req_id, request in list(self._legs.items()):
            if prompt_completes(request, num_scheduled_tokens.get(req_id, 0)):
                due[req_id] = list(block_ids_of(req_id))
                del self._legs[req_id]
                self._asked[req_id] = None
        return due


class DigestChannel:
    """Prefill digests, worker (rank 0) -> scheduler; `None` ends (verify_kv off, TP > 1)."""

    def __init__(self, engine_id: str, scheduler: bool) -> None:
        address = channel_address(engine_id, PURPOSE)
        self.wait_s = DIGEST_WAIT_S  # for digests still in flight (sent before the step's output)
        self._quiet_until = 0.0  # a wait ran out: none until then (DIGEST_WAIT_S)
        self._receiver = ResultReceiver(address) if scheduler else None
        self._sender = None if scheduler else ResultSender(address)

    def send(self, verifier: BlockVerifier | None, due: dict[str, list[int] | None]) -> None:
        """Worker, after the forward pass: digests of the blocks of the legs completed in it, and
        None for a leg it cannot digest (no verifier, or blocks None), so that its scheduler
        does not wait for them."""
        if due:
            self._sender.send({req_id: None if verifier is None or blocks is None
                               else kv_digest.encode(verifier.digests(blocks))
                               for req_id, blocks in due.items()})

    def take(self, req_id: str, block_size: int, asked: bool = True
             ) -> tuple[KvDigest | None, str | None]:
        """Scheduler, when a prefill leg finishes: (its digests, None), or (None, why there are
        none: "late", none came within wait_s; "undigested", its worker cannot digest them;
        "unasked", its worker was never asked, so none is waited for)."""
        wait = self.wait_s if asked and time.monotonic() >= self._quiet_until else 0.0
        encoded = self._receiver.take(req_id, wait, missing=_NONE_CAME)
        if encoded is _NONE_CAME:
            if wait:
                self._quiet_until = time.monotonic() + self.wait_s
            return None, "late" if asked else "unasked"
        if not isinstance(encoded, str):
            return None, "undigested"
        return KvDigest(algo=kv_digest.ALGO, block_size=block_size, ranks=[encoded]), None

    def close(self) -> None:
        for sock in (self._receiver, self._sender):
            if sock is not None:
                sock.close()


# -- consumer ---------------------------------------------------------------------------------------
def expected_digests(params: Any, block_size: int) -> tuple[str | None, str | None]:
    """(encoded digests of the prefill's blocks, None) from a decode request's params, or
    (None, why they cannot be used). Cheap: the worker decodes them, bounded by the number of
    blocks the read is for."""
    section = params.get(PD_SECTION_KEY) if isinstance(params, dict) else None
    raw = section.get("kv_digest") if isinstance(section, dict) else None
    if raw is None:
        return None, "the prefill stated no digests"
    try:
        stated = msgspec.convert(raw, KvDigest)
    except msgspec.ValidationError as exc:
        return None, f"malformed kv_digest: {exc}"
    if stated.algo != kv_digest.ALGO:
        return None, f"digest algorithm {stated.algo!r} is not {kv_digest.ALGO}"
    if stated.block_size != block_size:
        return None, f"the prefill's block size {stated.block_size} is not {block_size}"
    if len(stated.ranks) != 1:
        return None, f"digests of {len(stated.ranks)} TP ranks (only TP 1 is checked)"
    return stated.ranks[0], None


@dataclass
class _Read:
    """A read the decode worker started: where it landed, and what to compare it with."""

    local: list[int]            # local blocks (group 0), in order
    remote_blocks: int          # blocks the prefill holds for it (push: sends digests of)
    peer: str                   # the prefill's engine id
    expected: str | None = None  # encoded digests
    why: str | None = None       # why it cannot be checked
    pushed: bool = False         # push: the digests come by notification (DigestInbox)


@dataclass
class PdNixlWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: lease verdicts (pull prefill) and load outcomes (decode);
    a kv_both engine sends both."""

    lease: LeaseVerdicts = field(default_factory=LeaseVerdicts)
    loads: KvLoadOutcomes = field(default_factory=KvLoadOutcomes)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, PdNixlWorkerMeta):
            self.lease.aggregate(other.lease)
            self.loads.aggregate(other.loads)
        return self


class LoadVerifier:
    """Decode worker side: checks finished reads (pull) and pushes, reports bad blocks and
    outcomes."""

    def __init__(self, verifier: Callable[[], BlockVerifier | None],
                 layout_why: Callable[[], str | None], required: bool, faults: KvFaults,
                 stats: Any, inbox: DigestInbox | None = None,
                 hold_s: float = PUSH_DIGEST_WAIT_S,
                 senders_of: Callable[[str], Collection[str] | None] | None = None) -> None:
        self._verifier = verifier  # None until the KV caches are registered
        self._layout_why = layout_why  # asked per read: upstream settles its layout late
        self.required = required
        self.faults = faults
        self.stats = stats  # PdNixlStats (swapped by the caller each step)
        self._inbox = inbox  # push: where the prefills' digests arrive
        # push: the NIXL agents of a prefill engine (digests from any other agent are not taken;
        # None: from any, for callers that cannot tell)
        self._senders_of = senders_of or (lambda engine_id: None)
        self.hold_s = hold_s
        self._held: BoundedDict = BoundedDict(MAX_TRACKED)  # push req id -> monotonic deadline
        # held pushes whose request ended meanwhile (aborted): vLLM frees an aborted request's
        # blocks only once its receive is reported finished, so settle() reports them
        self._released: set[str] = set()
        self._reads: BoundedDict = BoundedDict(MAX_TRACKED)
        self._expected: BoundedDict = BoundedDict(MAX_TRACKED)  # req id -> (encoded | None, why)
        self._invalid: set[int] = set()
        # prefills already logged as unverified
        self._warned: BoundedDict = BoundedDict(MAX_TRACKED)
        self._outcomes = KvLoadOutcomes()
        self.mismatched_reads = 0  # reads that became failed loads here (for pd_recomputes)

    def expect(self, shipped: dict[str, tuple[str | None, str | None]]) -> None:
        """The scheduler's expected digests for reads it hands out this step."""
        for req_id, value in shipped.items():
            self._expected[req_id] = value

    def remember(self, req_id: str, local: list[int], remote_blocks: int, peer: str,
                 peer_why: str | None, pushed: bool = False) -> None:
        """A read or push starts (from upstream's metadata, before upstream consumes it). A push's
        prefill digests the `remote_blocks` == len(local) blocks it writes."""
        expected, why = self._expected.pop(req_id, (None, "the prefill stated no digests"))
        if not local:
            return  # a full local prefix hit: nothing is read
        if pushed:
            expected, why = None, None
        self._reads[req_id] = _Read(local, remote_blocks, peer, expected,
                                    self._layout_why() or peer_why or why, pushed)

    def forget(self, req_ids: set[str]) -> None:
        """Requests that ended (call before this step's settle())."""
        for req_id in req_ids:
            self._reads.pop(req_id, None)
            self._expected.pop(req_id, None)
            if self._held.pop(req_id, None) is not None:
                self._released.add(req_id)
            if self._inbox is not None:
                self._inbox.drop(req_id)  # a push that ended unchecked (aborted, failed)

    def settle(self, finished: set[str], failed: set[str], now: float | None = None) -> set[str]:
        """Check this step's finished loads (finished, not failed, released by the lease check);
        returns the loads that failed here as whole requests (`required` without a check).
        Pushes whose digests are not in yet leave `finished` until they are (or their wait ends);
        held pushes released now join it."""
        now = time.monotonic() if now is None else now
        failed_here: set[str] = set()
        if self._released:  # held, then ended: finished for vLLM to free, nothing to check
            finished |= self._released
            self._released.clear()
        for req_id in failed:
            self._held.pop(req_id, None)
            if self._inbox is not None:
                self._inbox.drop(req_id)
            read = self._reads.pop(req_id, None)
            if read is not None:
                self._record(req_id, LoadOutcome(len(read.local), len(read.local), 0,
                                                 read.why is None))
        for req_id in finished - failed:
            read = self._reads.get(req_id)
            if read is None:
                continue  # no read of ours (rejected params, a notify-only hit)
            if self._awaits_digests(req_id, read):
                finished.discard(req_id)
                self._held[req_id] = now + self.hold_s
                continue
            del self._reads[req_id]
            self._finish(req_id, read, failed_here)
        for req_id, until in list(self._held.items()):
            read = self._reads.get(req_id)
            if read is None:  # evicted from the bounded table: report it, so it is freed
                del self._held[req_id]
                finished.add(req_id)
                continue
            if self._awaits_digests(req_id, read) and now < until:
                continue
            if read.expected is None and read.why is None:
                read.why = f"no digests from the prefill within {self.hold_s:g} s"
                if self._inbox is not None:
                    self._inbox.drop(req_id)  # another agent's, if any
            del self._held[req_id], self._reads[req_id]
            finished.add(req_id)
            self._finish(req_id, read, failed_here)
        return failed_here

    def _awaits_digests(self, req_id: str, read: _Read) -> bool:
        """A push whose prefill's digests have not arrived (takes them when they have)."""
        if not read.pushed or read.expected is not None or read.why is not None:
            return False
        got = (self._inbox.take(req_id, self._senders_of(read.peer))
               if self._inbox is not None else None)
        if got is None:
            return True
        read.expected = got
        return False

    def _finish(self, req_id: str, read: _Read, failed_here: set[str]) -> None:
        self._inject(req_id, read)
        outcome = self._check(req_id, read)
        if outcome.failed and not outcome.checked:
            failed_here.add(req_id)  # `required`: nothing to check it against
        self._record(req_id, outcome)

    def _inject(self, req_id: str, read: _Read) -> None:
        verifier = self._verifier()
        if verifier is None or not self.faults.enabled:
            return
        if damage_landed(self.faults, verifier, req_id, read.local) is not None:
            self.stats.count(FAULTS_INJECTED_KEY)

    def _check(self, req_id: str, read: _Read) -> LoadOutcome:
        n = len(read.local)
        verifier = self._verifier()
        why = read.why or (None if verifier is not None else "no KV caches registered")
        expected = None
        if why is None:
            try:
                stated = kv_digest.decode(read.expected, read.remote_blocks)
            except ValueError as exc:
                why = f"unusable digests: {exc}"
            else:
                expected = paired_expected(stated, read.remote_blocks, n)
                if expected is None:
                    why = (f"{len(stated)} digests for {read.remote_blocks} remote and {n} "
                           f"local blocks")
        if why is not None:
            if self.required:
                logger.error("PdNixlConnector: request %s's load from %s cannot be verified "
                             "(%s) and verify_kv is `required`: its KV load failed",
                             req_id, read.peer, why)
                return LoadOutcome(n, n, 0, False)
            if read.peer not in self._warned:  # once per prefill (bounded): counted always
                self._warned[read.peer] = None
                logger.warning("PdNixlConnector: loads from prefill %s are not verified (%s, "
                               "first seen on request %s)", read.peer, why, req_id)
            return LoadOutcome(n, 0, 0, False)
        found = verifier.digests(read.local)
        k = first_mismatch(found, expected)
        if k is None:
            return LoadOutcome(n, 0, 0, True)
        mismatched = int(np.count_nonzero(found != expected))
        self._invalid.update(read.local[k:])
        self.mismatched_reads += 1
        logger.error("PdNixlConnector: request %s: %d of %d blocks loaded from %s do not match "
                     "the prefill's digests (first: block %d of the load); blocks from there "
                     "are not used (kv_load_failure_policy)", req_id, mismatched, n, read.peer, k)
        return LoadOutcome(n, n - k, mismatched, True)

    def _record(self, req_id: str, outcome: LoadOutcome) -> None:
        self._outcomes.record(req_id, outcome)
        count_outcome(self.stats, outcome)

    def take_invalid(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def take_outcomes(self) -> KvLoadOutcomes:
        out, self._outcomes = self._outcomes, KvLoadOutcomes()
        return out

    def take_mismatched_reads(self) -> int:
        n, self.mismatched_reads = self.mismatched_reads, 0
        return n

    def __len__(self) -> int:
        return len(self._reads)


def damage_landed(faults: KvFaults, blocks: BlockVerifier, req_id: str,
                  landed: list[int]) -> str | None:
    """Apply a `corrupt` or `reuse` fault to one of the blocks a load of `req_id` landed (the
    decode, before its check); returns the kind injected (None: none)."""
    if not landed:
        return None
    if (rule := faults.take("corrupt", req_id)) is not None:
        block = landed[position(rule, req_id, len(landed))]
        blocks.damage(block, position(rule, req_id + "/byte", blocks.block_bytes))
        return "corrupt"
    if (rule := faults.take("reuse", req_id)) is not None:
        block = landed[position(rule, req_id, len(landed))]
        blocks.overwrite(block, other_block(blocks, block))
        return "reuse"
    return None


def other_block(verifier: BlockVerifier, block: int) -> int:
    """The next block after `block` (cyclically) whose bytes differ from it: what a reused block
    would hold (`reuse`); `block` itself if every block holds the same bytes."""
    mine = verifier.digests([block])[0]
    for step in range(1, verifier.num_blocks):
        candidate = (block + step) % verifier.num_blocks
        if verifier.digests([candidate])[0] != mine:
            return candidate
    return block


# -- push ---------------------------------------------------------------------------------------------
def push_digests_notif(decode_req_id: str, rank: int, encoded: str) -> bytes:
    """The notification that carries a push's digests to its decode."""
    return PUSH_DIGESTS_PREFIX + msgspec.msgpack.encode([decode_req_id, rank, encoded])


def parse_push_digests(message: bytes) -> tuple[str, int, str] | None:
    """(decode request id, rank, encoded digests) of a notification; None if malformed or too
    large (a peer's bytes)."""
    if not message.startswith(PUSH_DIGESTS_PREFIX) or len(message) > MAX_PUSH_DIGESTS_BYTES:
        return None
    try:
        req_id, rank, encoded = msgspec.msgpack.decode(message[len(PUSH_DIGESTS_PREFIX):],
                                                       type=tuple[str, int, str])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return req_id, rank, encoded


class DigestInbox:
    """Decode side of push: wraps the worker's NIXL agent (upstream's push writer thread fetches its
    notifications) and takes the prefills' digest notifications out before upstream sees them;
    keeps the digests by decode request id and the agent that sent them (bounded in entries and
    bytes, oldest forgotten: a push that is aborted or fails leaves its digests behind; locked:
    the writer thread adds, the engine's main thread takes). Any NIXL peer can send one: `take`
    returns only digests from the agents it names (the prefill's, LoadVerifier), so another
    peer's notification neither replaces nor stands in for them."""

    def __init__(self, agent: Any, size: int = MAX_TRACKED,
                 max_bytes: int = MAX_INBOX_BYTES) -> None:
        self._agent = agent
        self._lock = threading.Lock()
        # (req id, sending agent) -> encoded (rank 0: TP 1), oldest first
        self._digests: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._senders: dict[str, set[str]] = {}  # req id -> agents it has digests from
        self._size, self._max_bytes, self._bytes = size, max_bytes, 0
        self.malformed = 0  # ever
        self._malformed_untaken = 0  # since take_malformed()

    def get_new_notifs(self, *args: Any, **kwargs: Any) -> dict[str, list[bytes]]:
        notifs = self._agent.get_new_notifs(*args, **kwargs)
        passed: dict[str, list[bytes]] = {}
        for peer, messages in notifs.items():
            passed[peer] = [m for m in messages if not m.startswith(PUSH_DIGESTS_PREFIX)]
            for message in messages:
                if message.startswith(PUSH_DIGESTS_PREFIX):
                    self._keep(peer, message)
        return passed

    def _keep(self, peer: str, message: bytes) -> None:
        parsed = parse_push_digests(message)
        if parsed is None or parsed[1] != 0:
            self.malformed += 1
            with self._lock:
                self._malformed_untaken += 1
            if self.malformed == 1:
                logger.warning("PdNixlConnector: unusable KV digest notification from agent %.200s "
                               "(%d bytes; only TP rank 0's are used); ignored", peer,
                               len(message))
            return
        req_id, _, encoded = parsed
        with self._lock:
            self._pop((req_id, peer))
            self._digests[(req_id, peer)] = encoded
            self._senders.setdefault(req_id, set()).add(peer)
            self._bytes += len(encoded)
            while len(self._digests) > self._size or self._bytes > self._max_bytes:
                self._pop(next(iter(self._digests)))

    def _pop(self, key: tuple[str, str]) -> str | None:
        encoded = self._digests.pop(key, None)
        if encoded is not None:
            self._bytes -= len(encoded)
            senders = self._senders.get(key[0])
            if senders is not None:
                senders.discard(key[1])
                if not senders:
                    del self._senders[key[0]]
        return encoded

    def take(self, req_id: str, agents: Collection[str] | None = None) -> str | None:
        """The request's digests from one of `agents` (None: from any), if they are in; the
        request's digests from every agent are dropped then."""
        with self._lock:
            senders = self._senders.get(req_id, set())
            chosen = next((a for a in sorted(senders) if agents is None or a in agents), None)
            if chosen is None:
                return None
            encoded = self._digests[(req_id, chosen)]
            self._drop(req_id)
            return encoded

    def drop(self, req_id: str) -> None:
        """Forget the request's digests (a push that ended unchecked)."""
        with self._lock:
            self._drop(req_id)

    def _drop(self, req_id: str) -> None:
        for agent in list(self._senders.get(req_id, ())):
            self._pop((req_id, agent))

    def take_malformed(self) -> int:
        """Unusable digest notifications since the last call (counted as dropped ones)."""
        with self._lock:
            n, self._malformed_untaken = self._malformed_untaken, 0
        return n

    def __len__(self) -> int:
        return len(self._digests)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


class PushDigestSender:
    """Prefill side of push: `before_write` (pd_nixl_guards.WriteGate, on upstream's writer thread,
    just before a WRITE starts) sends the digests of the blocks the WRITE copies to the decode's
    agent, once per request. Before the handshake names that agent it does nothing: upstream defers
    the WRITE and starts it (through the gate) again once the handshake is done."""

    def __init__(self, worker: Any, verifier: Callable[[], BlockVerifier | None],
                 layout_why: Callable[[], str | None], faults: KvFaults) -> None:
        self._worker = worker
        self._verifier = verifier
        self._layout_why = layout_why
        self._faults = faults
        self._sent: BoundedDict = BoundedDict(MAX_TRACKED)  # prefill req ids (values None)
        self._lock = threading.Lock()
        self._missing = 0   # WRITEs without digests, not yet counted
        self._injected = 0  # `drop_write`s, not yet counted
        self._warned: BoundedDict = BoundedDict(1024)  # decode engines logged as unverified

    def before_write(self, request_id: str, local_block_ids: Any,
                     registration: dict[str, Any]) -> bool:
        """Send the digests; False: do not start the WRITE (`drop_write`, its notification sent)."""
        worker = self._worker
        engine = registration.get("decode_engine_id")
        agent = remote_agent(worker, engine, worker.tp_rank) if isinstance(engine, str) else None
        if agent is None:
            return True  # handshake pending (upstream defers the WRITE) or no usable engine id
        decode_req_id = str(registration.get("request_id"))
        with self._lock:
            first = request_id not in self._sent
            self._sent[request_id] = None
        if first:
            try:
                encoded, why = self._digests(local_block_ids, registration)
                if encoded is not None:
                    worker.nixl_wrapper.send_notif(
                        agent, notif_msg=push_digests_notif(decode_req_id, worker.tp_rank,
                                                            encoded))
            except Exception as exc:  # noqa: BLE001 - the WRITE must not be lost with them
                encoded, why = None, f"sending them failed: {exc!r}"
            if encoded is None:
                self._unsent(engine, request_id, why)
        if self._faults.take("drop_write", request_id) is None:
            return True
        # the WRITE's own completion notification (upstream's format), with no WRITE before it
        worker.nixl_wrapper.send_notif(
            agent, notif_msg=f"{decode_req_id}:{worker.world_size}".encode())
        with self._lock:
            self._injected += 1
        return False

    def _digests(self, local_block_ids: Any, registration: dict[str, Any]
                 ) -> tuple[str | None, str | None]:
        """(encoded digests of the blocks the WRITE copies, None) or (None, why not)."""
        verifier = self._verifier()
        why = self._layout_why() or (None if verifier is not None else "no KV caches registered")
        if why is None and registration.get(ACCEPTS_DIGESTS_KEY) is not True:
            why = ("the decode does not ask for them (verify_kv off, not PdNixlConnector, or an "
                   "older version)")
        if why is None and registration.get("decode_tp_size") != 1:
            why = f"the decode has TP {registration.get('decode_tp_size')} (only TP 1 is checked)"
        if why is not None:
            return None, why
        mine, theirs = group0(local_block_ids), group0(registration.get("local_block_ids"))
        if not 0 < len(theirs) <= len(mine):
            return None, f"{len(theirs)} decode blocks for {len(mine)} prefill blocks"
        # upstream WRITEs the tail of the prefill's blocks into the decode's (prefix caching)
        return kv_digest.encode(verifier.digests(mine[len(mine) - len(theirs):])), None

    def _unsent(self, engine: str, request_id: str, why: str | None) -> None:
        with self._lock:
            self._missing += 1
            first = engine not in self._warned
            self._warned[engine] = None
        if first:
            logger.warning("PdNixlConnector: pushes to decode %s carry no KV digests (%s, first "
                           "seen on request %s): it loads them unverified", engine, why,
                           request_id)

    def take_counts(self) -> tuple[int, int]:
        """(WRITEs without digests, `drop_write`s) since the last call."""
        with self._lock:
            counts = self._missing, self._injected
            self._missing = self._injected = 0
        return counts
