"""SGLang transfer backend `pd-nixl`: the prefill's pages move over NIXL (UCX), pulled by the
decode (READ, the default) or pushed by the prefill (WRITE, `PD_NIXL_MODE=push` on both sides),
under a lease with heartbeats (transfer/nixl_rooms.py has the pull protocol). The KV is registered
where the engine keeps it: host memory (`--device cpu`) or GPU memory (`--device cuda`: NIXL's
VRAM, SGLang's gpu_id); each side's registry record says which, for the other's descriptors.

Over host_kv.py's SGLang contract:
- prefill: `send(kv_indices)` only records the pages (the KV stays where the engine computed
  it) and after the last chunk leases them to the room. Decode heartbeats extend the lease.
- pull: the last chunk publishes the room in the bootstrap registry (pages, the request's
  metadata row, `lease_until`). The prefill's `poll` stays Transferring until the decode's READ
  notification arrives (Success: SGLang frees the pages) or the lease runs out (Failed: freed,
  and no decode may start a read any more). The decode's `init` adds the prefill rank's NIXL
  agent (its metadata is in the registry record); its `poll` waits for the room (sending
  heartbeats, watching the prefill's registry), starts one READ of the pages after its cached
  prefix into its own pages once the lease has more than START_MARGIN_S left (with less, a
  heartbeat asks for more), and is Success when the READ is done. A room whose lease ran out
  leaves a tombstone: a late decode fails at once.
- push: the decode publishes a target in the prefill's registry (its NIXL agent, its pages, the
  first page after its cached prefix); the prefill claims it (the registry settles who owns the
  decode's pages: a claimed target cannot be withdrawn) and WRITEs its pages there, with the
  metadata row and the write's start time in the notification NIXL delivers after the data. The
  prefill is Success when the WRITE is done; the decode when that notification arrives, unless
  it comes later than MAX_WRITE_S - START_MARGIN_S after the start (by then the prefill may have
  given up and freed its pages: the bytes are not trusted). A decode that hears nothing within
  SGLang's waiting timeout withdraws its target and fails; if the prefill claimed it, the decode
  keeps its pages until MAX_WRITE_S after the claim. A prefill whose lease runs out before a
  target appears expires the room: a decode that comes later fails when it publishes.

SGLang's own NIXL backend is push only and has no lease. Options: `NixlOptions`
(transfer/options.py, PdNixlConnector's too) from the environment: PD_NIXL_MODE (pull or push;
the decode refuses a prefill in the other mode), PD_NIXL_LEASE_S (how long a prefill keeps a
finished room's pages for the decode), PD_TRANSFER_THREADS_NICE and PD_PROGRESS_WAIT_US (NIXL's
progress thread: nice 19 and a 1 ms wait for work on a CPU engine by default; "none" leaves it as
upstream has it); docs/connectors.md has their table. UCX on CPU: UCX_NET_DEVICES=lo on one host.
Registry calls are signed with the peers' secret (PD_PEER_SECRET_FILE or PD_PEER_SECRET; transfer/peer_auth.py), and a NIXL peer must be the
agent its record names. Any NIXL peer can send notifications: a push decode keeps a WRITE
notification only from its room's prefill agent and no larger than one of its room can be; a pull
room ends only by the DONE of the agent whose START came first (transfer/nixl_rooms.py).

Verified hand-off (issue 28; transfer/page_digests.py): the prefill states one ws64 digest per
page, in the room record (pull, `page_digests`, over all the room's pages) or in the WRITE's
notification (push, over the pages it writes); the decode checks the pages it received before it
uses them (before the metadata row is set and the room succeeds). A mismatch fails the room
(KVPoll.Failed, "KV digest mismatch at page N": SGLang aborts the request, pd-router retries it
with a fresh prefill). A prefill that states none (an older one, or device KV) is used as
`unverified`, counted and logged. Fault injection (PD_KV_FAULTS, for tests, refused unless
PD_KV_FAULTS_ALLOWED=1): `corrupt` on the decode (one byte of one landed page, before the
check), `drop_write` on a push prefill (the notification without the WRITE); rooms are matched as
`room:<number>`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import time
import uuid

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs

from pd_plugins.connectors.sglang.host_kv import (
    HostKVManager,
    HostKVReceiver,
    HostKVSender,
    REGISTRY_CALL_S,
    ROOM_FAULTS,
    RegistryBootstrapServer,
    engine_device,
    page_ranges,
)
from pd_plugins.transfer import bootstrap_registry
from pd_plugins.transfer.kv_faults import KvFaults
from pd_plugins.transfer.nixl_rooms import (
    MAX_READ_S,
    MAX_WRITE_S,
    START_MARGIN_S,
    HOST,
    PUSHED,
    LeaseTable,
    Memory,
    NixlRoomAgent,
    PushNote,
    parse_push_note,
    push_note,
)
from pd_plugins.transfer.options import KvFaultOptions, NixlOptions, from_env
from pd_plugins.transfer.page_digests import PageChecks, corrupt, fault_target, page_digests
from pd_plugins.transfer.page_runs import decode_pages, encode_pages
from pd_plugins.transfer.transfer_threads import lowered_new_threads, paced_progress

logger = logging.getLogger("pd_plugins.sglang")

BACKEND_NAME = "pd-nixl"
MAX_ARRIVALS = 100_000  # push, decode: rooms whose WRITE notification a receiver awaits
NOTE_OVERHEAD = 96  # a WRITE notification's bytes besides its metadata row and digests
ABORT_WAIT_S = 2.0  # push: how long an aborted prefill lets its WRITE finish before freeing


class PdNixlKVManager(HostKVManager):
    backend_name = BACKEND_NAME
    device_kv = True  # NIXL registers CUDA memory (VRAM) and moves it without a host copy

    def _open(self) -> None:
        options = from_env(NixlOptions, BACKEND_NAME)
        self.transfer_mode = options.mode
        # refused (the engine does not start) unless PD_KV_FAULTS_ALLOWED=1, never in production
        self.faults = KvFaults.from_spec(from_env(KvFaultOptions, BACKEND_NAME).faults,
                                         f"{BACKEND_NAME} (SGLang)")
        self.checks = PageChecks()  # decode: what its receivers found
        role = "prefill" if self.mode == DisaggregationMode.PREFILL else "decode"
        # NIXL's progress thread: lowest priority (PD_TRANSFER_THREADS_NICE), and it waits for work
        # instead of polling without pause (PD_PROGRESS_WAIT_US); transfer/transfer_threads.py
        cpu_engine = engine_device(self.server_args).startswith("cpu")
        with lowered_new_threads(options.nice_on(cpu_engine), "pd-nixl (SGLang)"), \
                paced_progress(options.progress_wait_on(cpu_engine), "pd-nixl (SGLang)"):
            self.agent = NixlRoomAgent(
                f"pd-sglang-{role}-{self.rank_key}-{uuid.uuid4().hex[:12]}", self.buffers.regions(),
                self.buffers.memory)
        # a decode heartbeats for its room while it waits, up to SGLang's waiting timeout
        self.leases = LeaseTable(options.kv_lease_duration, max_extension_s=float(
            envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()))
        # push, decode: room -> (the prefill agent whose WRITE notification it awaits, the most
        # bytes that notification may have); and room -> the notification, once it came
        self.awaited: dict[int, tuple[str, int]] = {}
        self.arrivals: dict[int, PushNote] = {}
        self.notes_refused = 0  # WRITE notifications no receiver awaits from their sender
        self._next_refusal_log = 0.0

    def _record(self) -> dict:
        return {"agent_metadata": base64.b64encode(self.agent.metadata()).decode(),
                "agent_name": self.agent.name, "kv": self.kv_items(),
                "memory": list(self.buffers.memory), "mode": self.transfer_mode}

    def kv_items(self) -> list[list[int]]:
        """[address, page bytes] of each KV buffer: where a peer reads or writes page p."""
        return [[addr, width] for addr, width in self.buffers.page_items()]

    def peer_items(self, items: list, room: int, peer_role: str) -> list[tuple[int, int]]:
        """A peer's `kv_items` (from its registry record), checked against this rank's."""
        theirs = [(int(addr), int(width)) for addr, width in items]
        if [w for _, w in theirs] != [w for _, w in self.kv_items()]:
            raise RuntimeError(f"room {room}: the {peer_role}'s KV items differ from this "
                               "rank's: not the same model and KV layout")
        return theirs

    def pump(self) -> None:
        """Notifications: a decode's (heartbeats, read starts, read completions) feed the
        prefill's leases; a prefill's completed WRITEs (push) wait for their receivers, kept only
        when a receiver awaits that room's from that agent, at its size at most."""
        others = []
        for agent, message in self.agent.notifications():
            if message.startswith(PUSHED + b":"):
                self._arrived(agent, message)
            else:
                others.append((agent, message))
        if others:
            self.leases.feed(others)

    def await_write(self, room: int, peer: str, max_bytes: int) -> None:
        """A receiver's room: its WRITE notification may come from agent `peer`."""
        self.awaited.pop(room, None)
        self.awaited[room] = (peer, max_bytes)
        while len(self.awaited) > MAX_ARRIVALS:  # SGLang concludes its receivers: not reached
            self.awaited.pop(next(iter(self.awaited)))

    def settled(self, room: int) -> None:
        """The room's receiver concluded: no notification of it is kept any more."""
        self.awaited.pop(room, None)
        self.arrivals.pop(room, None)

    def _arrived(self, agent: str, message: bytes) -> None:
        _, _, rest = message.partition(b":")
        room_b = rest[:21].partition(b":")[0]
        expected = self.awaited.get(int(room_b)) if room_b.isdigit() else None
        if expected is None or expected[0] != agent or len(message) > expected[1]:
            # not the room's prefill (any NIXL peer can notify), not a room awaited, or larger
            # than a notification of that room can be: never parsed, never kept
            self.notes_refused += 1
            if time.monotonic() >= self._next_refusal_log:  # at most one line a minute
                self._next_refusal_log = time.monotonic() + 60
                logger.warning("pd-nixl: a WRITE notification (%d bytes) from NIXL agent %r for "
                               "a room that awaits none from it: ignored (%d so far)",
                               len(message), agent[:80], self.notes_refused)
            return
        try:
            note = parse_push_note(message)
        except ValueError as exc:
            logger.warning("pd-nixl: %s", exc)
            return
        self.arrivals[note.room] = note

    def close(self) -> None:
        self.agent.close()


def peer_memory(record: dict) -> Memory:
    """The memory a peer's KV is in, from its record (host memory for records without it)."""
    kind, device_id = record.get("memory") or HOST
    if kind not in ("DRAM", "VRAM"):
        raise RuntimeError(f"a pd-nixl peer registered KV in unknown memory {kind!r}")
    return Memory(kind, int(device_id))


class _OneTransfer:
    """The NIXL transfer a sender (push) or receiver (pull) has under way, if any."""

    xfer = None

    def _drop_xfer(self) -> None:
        xfer, self.xfer = self.xfer, None
        if xfer is not None:
            self.mgr.agent.release(xfer)


class PdNixlKVSender(_OneTransfer, HostKVSender):
    pages: list[int]
    published_until = 0.0
    digests: str | None = None  # pull: the room's page digests, as published

    def _put_pages(self, pages: np.ndarray) -> None:
        self.pages = [*getattr(self, "pages", []), *pages.tolist()]
        self.bytes_moved += int(pages.size) * self.mgr.buffers.page_bytes

    @property
    def _key(self) -> str:
        return bootstrap_registry.room_key(self.room, self.mgr.rank_key)

    def _finish(self, aux: bytes) -> None:
        self.aux_row = aux
        self.aux = base64.b64encode(aux).decode()
        until = self.mgr.leases.lease(self.room)
        if self.mgr.transfer_mode == "pull":
            try:
                # the room is complete: what the decode must find in these pages (None: device KV)
                self.digests = page_digests(self.mgr.buffers.kv, getattr(self, "pages", []))
                self._publish(until)
            except ROOM_FAULTS:  # the room fails: SGLang frees its pages, no decode may read them
                self._forget(expired=True)
                raise

    def _publish(self, lease_until: float) -> None:
        record = {"page_runs": encode_pages(getattr(self, "pages", [])), "aux": self.aux,
                  "lease_until": lease_until}
        if self.digests is not None:
            record["page_digests"] = self.digests
            if len(json.dumps(record, separators=(",", ":"))) > bootstrap_registry.MAX_RECORD_BYTES:
                # a huge fragmented room: its KV still moves, unverified (the decode says so)
                logger.warning("pd-nixl: room %d: %d page digests exceed the registry's record "
                               "cap; published without them", self.room, len(self.pages))
                self.digests = None
                del record["page_digests"]
        bootstrap_registry.put_room(self.mgr.bootstrap_addr, self._key, record)
        self.published_until = lease_until

    def _progress(self) -> None:
        self.mgr.pump()
        if self.mgr.transfer_mode == "push":
            try:
                return self._push()
            except ROOM_FAULTS:  # the room fails (SGLang neither aborts nor clears it then):
                self.mgr.leases.forget(self.room)  # its lease goes with it, or the table grows
                raise
        try:
            return self._pull()
        except ROOM_FAULTS:  # the room fails and SGLang frees its pages (it neither aborts nor
            # clears the room then): the lease goes, and the record becomes a tombstone, so no
            # decode starts a READ of pages that may hold another request's KV by then
            self._forget(expired=True)
            raise

    def _pull(self) -> None:
        status = self.mgr.leases.status(self.room)
        if status == "held":
            until = self.mgr.leases.until(self.room)
            if until > self.published_until + 1.0:  # heartbeats extended it: tell the decode
                self._publish(until)
            return
        if status == "done":
            self._forget()
            return self._succeed()
        self._forget(expired=True)
        self._fail(TimeoutError(f"room {self.room}: no decode read its KV within the lease "
                                f"({self.mgr.leases.lease_s:.0f} s and heartbeats)"))

    # -- push ---------------------------------------------------------------------------------
    write_started = 0.0

    def _push(self) -> None:
        """Claim the decode's target once it is published, WRITE into it, wait for the WRITE."""
        if self.xfer is None:
            return self._claim_and_write()
        state = self.mgr.agent.state(self.xfer)
        if state == "PROC":
            if time.time() > self.write_started + MAX_WRITE_S:
                self._drop_xfer()  # the decode will not trust a notification this late
                raise TimeoutError(f"room {self.room}: the WRITE did not finish within "
                                   f"{MAX_WRITE_S:.0f} s")
            return None
        self._drop_xfer()
        self.mgr.leases.forget(self.room)
        if state != "DONE":
            raise ConnectionError(f"room {self.room}: NIXL WRITE failed ({state})")
        return self._succeed()

    def _claim_and_write(self) -> None:
        status, target = bootstrap_registry.target_action(self.mgr.bootstrap_addr, self._key,
                                                          "claim")
        if status == 409:
            raise TimeoutError(f"room {self.room}: the decode gave up waiting ({target['error']})")
        if status == 404:  # no decode is ready yet: hold the pages while the lease lasts
            if self.mgr.leases.status(self.room) == "expired":
                self._forget(expired=True)
                raise TimeoutError(f"room {self.room}: no decode was ready for its KV within the "
                                   f"lease ({self.mgr.leases.lease_s:.0f} s and heartbeats)")
            return None
        peer = self.mgr.agent.add_peer(base64.b64decode(target["agent_metadata"]),
                                       target.get("agent_name"))
        remote_kv = self.mgr.peer_items(target["kv"], self.room, "decode")
        first = int(target["first_page"])
        dest = decode_pages(target.get("page_runs"), self.mgr.buffers.num_pages).tolist()
        pages = getattr(self, "pages", [])[first:first + len(dest)]
        if len(pages) != len(dest):
            raise RuntimeError(f"room {self.room}: this prefill holds {len(self.pages)} pages; the "
                               f"decode wants {first + len(dest)}")
        remote = page_ranges(remote_kv, dest)
        self.write_started = time.time()
        # the digests of exactly the pages written (None on device KV: the decode says unverified)
        note = push_note(self.room, self.write_started, self.aux_row,
                         page_digests(self.mgr.buffers.kv, pages))
        if self.mgr.faults.enabled and self.mgr.faults.take("drop_write", fault_target(self.room)):
            # fault injection: the notification as if written, the decode's pages untouched
            self.mgr.agent.notify(peer, note)
            self.mgr.leases.forget(self.room)
            return self._succeed()
        self.xfer = self.mgr.agent.write(peer, self.mgr.buffers.page_ranges(pages),
                                         remote, note, peer_memory(target))

    def _forget(self, expired: bool = False) -> None:
        """Drop the room; an expired one leaves a tombstone, so a late decode fails at once."""
        self.mgr.leases.forget(self.room)
        if self.mgr.transfer_mode == "push":
            if expired:  # an open target becomes expired; a claimed one is being written
                with contextlib.suppress(bootstrap_registry.RegistryUnreachable, RuntimeError):
                    bootstrap_registry.target_action(self.mgr.bootstrap_addr, self._key, "expire")
            return
        try:
            if expired:
                bootstrap_registry.put_room(self.mgr.bootstrap_addr, self._key, {"expired": True})
            else:
                bootstrap_registry.drop_room(self.mgr.bootstrap_addr, self._key)
        except (bootstrap_registry.RegistryUnreachable, RuntimeError):
            pass

    def abort(self) -> None:
        if self.state == KVPoll.Success:
            return
        if self.next_page and self.next_page >= (self.num_pages or 0):
            self._forget(expired=True)  # published: no decode may start a transfer any more
        if self.xfer is not None:
            # push: SGLang frees the pages once this returns; a WRITE still reading them would
            # send torn KV, so give it a moment to finish (on one host it takes milliseconds)
            deadline = time.monotonic() + ABORT_WAIT_S
            while self.mgr.agent.state(self.xfer) == "PROC" and time.monotonic() < deadline:
                time.sleep(0.001)
            self._drop_xfer()
        super().abort()



class PdNixlKVReceiver(_OneTransfer, HostKVReceiver):
    peer: str | None = None
    digests_required = False  # the prefill's record says host KV: its WRITEs state digests
    kv_verdict: str | None = None  # verified / unverified once the KV is in (a mismatch fails)

    def _accept(self, record: dict) -> None:
        theirs = record.get("mode", "pull")
        if theirs != self.mgr.transfer_mode:
            raise RuntimeError(f"room {self.room}: the prefill at {self.prefill_addr} runs pd-nixl "
                               f"in {theirs} mode, this decode in {self.mgr.transfer_mode} mode "
                               "(set PD_NIXL_MODE the same on both)")
        self.peer = self.mgr.agent.add_peer(base64.b64decode(record["agent_metadata"]),
                                            record.get("agent_name"))
        self.remote_kv = self.mgr.peer_items(record["kv"], self.room, "prefill")
        self.remote_memory = peer_memory(record)
        # a prefill that says its KV is in host memory states page digests with every WRITE
        self.digests_required = record.get("memory") is not None and self.remote_memory.on_host

    def _heartbeat(self) -> None:
        if self.peer is not None:
            self.mgr.agent.notify(self.peer, b"HB:%d" % self.room)

    def _progress(self) -> None:
        if self.mgr.transfer_mode == "push":
            return self._await_write()
        if self.xfer is None:
            return self._start_read()
        state = self.mgr.agent.state(self.xfer)
        if state == "PROC":
            if time.monotonic() > self.read_deadline:
                self._drop_xfer()
                raise TimeoutError(f"room {self.room}: the READ did not finish within "
                                   f"{MAX_READ_S - START_MARGIN_S:.0f} s; its pages may be freed")
            return
        self._drop_xfer()
        if state != "DONE":
            raise ConnectionError(f"room {self.room}: NIXL READ from {self.peer} failed ({state})")
        self._check_kv(self.stated_digests, self.first_page, self.held_pages)
        self.mgr.buffers.set_aux_row(self.aux_index, self.aux)
        self._succeed()

    def _check_kv(self, stated: str | None, first_page: int, max_pages: int) -> None:
        """The landed pages against the prefill's digests, before anything uses them (raises
        on a mismatch: the room fails). The `corrupt` fault strikes just before."""
        corrupt(self.mgr.faults, self.mgr.buffers.kv, self.pages, self.room)
        self.kv_verdict = self.mgr.checks.check(
            self.mgr.buffers.kv, self.pages, stated, first_page, max_pages, self.room,
            self.prefill_addr)

    def _start_read(self) -> None:
        key = bootstrap_registry.room_key(self.room, self.prefill_rank_key)
        try:
            record = self._ask(bootstrap_registry.get_room, key)
        except bootstrap_registry.RegistryUnreachable:
            record = None
        if record is None:
            return self._check_waiting()
        if record.get("expired"):
            raise TimeoutError(f"room {self.room}: the prefill's lease ran out before this decode "
                               "could read; the KV is gone")
        if record["lease_until"] - time.time() < START_MARGIN_S:
            # too little left to start a read: ask for more and look again (the prefill
            # extends the lease and republishes the room, or lets it expire)
            self._heartbeat()
            return self._check_waiting()
        held = decode_pages(record.get("page_runs"), self.mgr.buffers.num_pages)
        wanted = held[self.first_page:self.first_page + len(self.pages)]
        if len(wanted) != len(self.pages):
            raise RuntimeError(f"room {self.room}: the prefill holds {len(held)} pages; this "
                               f"decode needs {self.first_page + len(self.pages)}")
        remote = page_ranges(self.remote_kv, wanted)
        self.aux = base64.b64decode(record["aux"])
        self.stated_digests, self.held_pages = record.get("page_digests"), len(held)
        self.mgr.agent.notify(self.peer, b"START:%d" % self.room)
        self.read_deadline = time.monotonic() + MAX_READ_S - START_MARGIN_S
        self.xfer = self.mgr.agent.read(self.peer, self.mgr.buffers.page_ranges(self.pages),
                                        remote, b"DONE:%d" % self.room, self.remote_memory)
        self.bytes_moved = len(self.pages) * self.mgr.buffers.page_bytes

    # -- push ---------------------------------------------------------------------------------
    target_sent = False       # a publication was sent: the registry may hold the target
    target_published = False  # ... and answered that it does
    claimed_at: float | None = None  # (maybe) claimed then: pages kept till then + MAX_WRITE_S
    unsettled: str = ""  # why the decode keeps its pages without a known claim

    @property
    def _target_key(self) -> str:
        return bootstrap_registry.room_key(self.room, self.prefill_rank_key)

    def _await_write(self) -> None:
        """Publish this decode's pages as the room's target, then wait for the WRITE's
        notification; past the waiting timeout, withdraw the target. If the prefill has claimed
        it, or the registry cannot say (the target unknown to it, or no answer), a WRITE may
        still land: keep the pages until MAX_WRITE_S after the claim (or after now)."""
        if not self.target_published:
            if not self.target_sent:  # from here on its WRITE may come: from its prefill only
                self.mgr.await_write(self.room, self.peer, self._max_note_bytes())
            self.target_sent = True
            try:
                opened = self._ask(bootstrap_registry.put_target, self._target_key, {
                    "agent_metadata": base64.b64encode(self.mgr.agent.metadata()).decode(),
                    "agent_name": self.mgr.agent.name, "kv": self.mgr.kv_items(),
                    "memory": list(self.mgr.buffers.memory),
                    "page_runs": encode_pages(self.pages), "first_page": self.first_page})
            except bootstrap_registry.RegistryUnreachable:
                opened = None  # it may have been published all the same (the answer stalled)
            if opened is False:
                raise TimeoutError(f"room {self.room}: the prefill's lease ran out before this "
                                   "decode was ready; the KV is gone")
            self.target_published = bool(opened)
        self.mgr.pump()
        arrived = self.mgr.arrivals.pop(self.room, None)
        if arrived is not None:
            return self._written(arrived)
        if time.monotonic() > self.waiting_deadline:
            if self.claimed_at is not None:
                raise TimeoutError(
                    f"room {self.room}: no KV from the prefill's WRITE within {MAX_WRITE_S:.0f} s "
                    + ("of its claim on this decode's pages" if not self.unsettled else
                       f"after the waiting timeout; its pages were kept that long because "
                       f"{self.unsettled}"))
            try:
                status, answer = self._ask(bootstrap_registry.target_action, self._target_key,
                                           "withdraw")
            except bootstrap_registry.RegistryUnreachable as exc:
                status, answer = None, {"error": str(exc)}
            if status == 409:  # claimed: a WRITE may be under way into these pages
                self.claimed_at = float(answer["claimed_at"])
                self.waiting_deadline = (time.monotonic()
                                         + max(0.0, self.claimed_at + MAX_WRITE_S - time.time()))
                return None
            if status != 200:  # 404 (not known: evicted, or never published) or no answer
                self.unsettled = (f"the registry could not say whether the prefill claimed them "
                                  f"({status or 'no answer'}: {str(answer.get('error'))[:200]})")
                self.claimed_at = time.time()  # a claim now, at the latest
                self.waiting_deadline = time.monotonic() + MAX_WRITE_S
                return None
        if self.claimed_at is not None:  # kept whatever the heartbeats say, until the deadline
            return None
        return self._check_waiting()

    def abort(self) -> None:
        if self.state != KVPoll.Success and self.target_sent and self.claimed_at is None:
            # best effort: a target the prefill has not claimed is never written after this.
            # Sent even while the registry is quiet after a stalled call (not through _ask):
            # that call may have been the publication, landed with its answer lost. (A 409,
            # claimed, is not waited for: SGLang frees the pages; see docs/connectors.md.)
            with contextlib.suppress(bootstrap_registry.RegistryUnreachable, RuntimeError):
                bootstrap_registry.target_action(self.prefill_addr, self._target_key,
                                                 "withdraw", timeout_s=REGISTRY_CALL_S)
        super().abort()

    def _max_note_bytes(self) -> int:
        """The most bytes this room's WRITE notification can have: the engine's metadata row and
        one digest per page written, base64, and the rest."""
        def b64(n: int) -> int:
            return 4 * -(-n // 3)

        aux = sum(buf.shape[1] for buf in self.mgr.buffers.aux)
        return NOTE_OVERHEAD + b64(aux) + b64(8 * len(self.pages))

    def _fail(self, exc: Exception) -> None:
        super()._fail(exc)
        self.mgr.settled(self.room)

    def _succeed(self) -> None:
        super()._succeed()
        self.mgr.settled(self.room)

    def _written(self, note: PushNote) -> None:
        with contextlib.suppress(bootstrap_registry.RegistryUnreachable, RuntimeError):
            self._ask(bootstrap_registry.drop_target, self._target_key)
        if time.time() > note.started + MAX_WRITE_S - START_MARGIN_S:
            raise TimeoutError(f"room {self.room}: the WRITE finished "
                               f"{time.time() - note.started:.0f} s after it started; the prefill "
                               "may have freed its pages meanwhile")
        if note.digests is None and self.digests_required:
            raise RuntimeError(f"room {self.room}: the prefill's record says its KV is in host "
                               "memory, whose WRITE notifications state page digests; this one "
                               "states none: not used")
        # the prefill stated the digests of exactly the pages it wrote into this decode's
        self._check_kv(note.digests, 0, len(self.pages))
        self.mgr.buffers.set_aux_row(self.aux_index, note.aux)
        self.bytes_moved = len(self.pages) * self.mgr.buffers.page_bytes
        self._succeed()


CLASSES = {"manager": PdNixlKVManager, "sender": PdNixlKVSender, "receiver": PdNixlKVReceiver,
           "bootstrap_server": RegistryBootstrapServer}
