"""SGLang transfer backend `pd-nixl`: the decode pulls (NIXL READ over UCX) the prefill's pages,
under a lease with heartbeats (transfer/nixl_rooms.py has the protocol).

Over host_kv.py's SGLang contract:
- prefill: `send(kv_indices)` only records the pages (the KV stays where the engine computed
  it); the last chunk publishes the room in the bootstrap registry (pages, the request's metadata
  row, `lease_until`). `poll` stays Transferring until the decode's READ notification arrives
  (Success: SGLang frees the pages) or the lease runs out (Failed: freed, and no decode may
  start a read any more). Decode heartbeats extend the lease; the room record follows.
- decode: `init` adds the prefill rank's NIXL agent (its metadata is in the registry record);
  `poll` waits for the room (sending heartbeats, watching the prefill's registry), starts one
  READ of the pages after its cached prefix into its own pages once the lease has more than
  START_MARGIN_S left (with less, a heartbeat asks for more), and is Success when the READ is
  done. A room whose lease ran out leaves a tombstone: a late decode fails at once.

SGLang's own NIXL backend is push only and has no lease. Options (environment):
PD_NIXL_LEASE_S (how long a prefill keeps a finished room's pages for the decode, default 30);
PD_TRANSFER_THREADS_NICE (the nice value of NIXL's threads, default 19: its progress thread polls
without pause; "none" leaves them alone). UCX on CPU: UCX_NET_DEVICES=lo on one host.
"""

from __future__ import annotations

import base64
import os
import time
import uuid

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode

from pd_plugins.connectors.sglang.host_kv import (
    HostKVManager,
    HostKVReceiver,
    HostKVSender,
    RegistryBootstrapServer,
)
from pd_plugins.transfer import bootstrap_registry
from pd_plugins.transfer.nixl_rooms import MAX_READ_S, START_MARGIN_S, LeaseTable, NixlRoomAgent
from pd_plugins.transfer.transfer_threads import lowered_new_threads, nice_from_env

BACKEND_NAME = "pd-nixl"


class PdNixlKVManager(HostKVManager):
    backend_name = BACKEND_NAME

    def _open(self) -> None:
        role = "prefill" if self.mode == DisaggregationMode.PREFILL else "decode"
        # NIXL's progress thread polls without pause: lowest priority (PD_TRANSFER_THREADS_NICE)
        with lowered_new_threads(nice_from_env(), "pd-nixl (SGLang)"):
            self.agent = NixlRoomAgent(
                f"pd-sglang-{role}-{self.rank_key}-{uuid.uuid4().hex[:12]}", self.buffers.regions())
        self.leases = LeaseTable(float(os.environ.get("PD_NIXL_LEASE_S", "30")))

    def _record(self) -> dict:
        return {"agent_metadata": base64.b64encode(self.agent.metadata()).decode(),
                "kv": [[buf.ctypes.data, buf.shape[1]] for buf in self.buffers.kv]}

    def pump(self) -> None:
        """The decodes' notifications (heartbeats, read starts, read completions) -> leases."""
        self.leases.feed(self.agent.notifications())

    def close(self) -> None:
        self.agent.close()


class PdNixlKVSender(HostKVSender):
    pages: list[int]
    published_until = 0.0

    def _put_pages(self, pages: np.ndarray) -> None:
        self.pages = [*getattr(self, "pages", []), *pages.tolist()]
        self.bytes_moved += int(pages.size) * self.mgr.buffers.page_bytes

    @property
    def _key(self) -> str:
        return bootstrap_registry.room_key(self.room, self.mgr.rank_key)

    def _finish(self, aux: bytes) -> None:
        self.aux = base64.b64encode(aux).decode()
        self._publish(self.mgr.leases.lease(self.room))

    def _publish(self, lease_until: float) -> None:
        bootstrap_registry.put_room(self.mgr.bootstrap_addr, self._key, {
            "pages": getattr(self, "pages", []), "aux": self.aux, "lease_until": lease_until})
        self.published_until = lease_until

    def _progress(self) -> None:
        self.mgr.pump()
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

    def _forget(self, expired: bool = False) -> None:
        """Drop the room; an expired one leaves a tombstone, so a late decode fails at once."""
        self.mgr.leases.forget(self.room)
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
            self._forget(expired=True)  # published: no decode may start a read any more
        super().abort()



class PdNixlKVReceiver(HostKVReceiver):
    xfer = None
    peer: str | None = None

    def _accept(self, record: dict) -> None:
        self.peer = self.mgr.agent.add_peer(base64.b64decode(record["agent_metadata"]))
        self.remote_kv = [(int(addr), int(width)) for addr, width in record["kv"]]
        if [w for _, w in self.remote_kv] != [buf.shape[1] for buf in self.mgr.buffers.kv]:
            raise RuntimeError(f"room {self.room}: the prefill's KV items differ from this "
                               "decode's: not the same model and KV layout")

    def _heartbeat(self) -> None:
        if self.peer is not None:
            self.mgr.agent.notify(self.peer, b"HB:%d" % self.room)

    def _progress(self) -> None:
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
        self.mgr.buffers.set_aux_row(self.aux_index, self.aux)
        self._succeed()

    def _start_read(self) -> None:
        key = bootstrap_registry.room_key(self.room, self.prefill_rank_key)
        try:
            record = bootstrap_registry.get_room(self.prefill_addr, key)
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
        wanted = record["pages"][self.first_page:self.first_page + len(self.pages)]
        if len(wanted) != len(self.pages):
            raise RuntimeError(f"room {self.room}: the prefill holds {len(record['pages'])} "
                               f"pages; this decode needs {self.first_page + len(self.pages)}")
        remote = [(addr + int(p) * width, width) for addr, width in self.remote_kv for p in wanted]
        self.aux = base64.b64decode(record["aux"])
        self.mgr.agent.notify(self.peer, b"START:%d" % self.room)
        self.read_deadline = time.monotonic() + MAX_READ_S - START_MARGIN_S
        self.xfer = self.mgr.agent.read(self.peer, self.mgr.buffers.page_ranges(self.pages),
                                        remote, b"DONE:%d" % self.room)
        self.bytes_moved = len(self.pages) * self.mgr.buffers.page_bytes

    def _drop_xfer(self) -> None:
        xfer, self.xfer = self.xfer, None
        if xfer is not None:
            self.mgr.agent.release(xfer)


CLASSES = {"manager": PdNixlKVManager, "sender": PdNixlKVSender, "receiver": PdNixlKVReceiver,
           "bootstrap_server": RegistryBootstrapServer}
