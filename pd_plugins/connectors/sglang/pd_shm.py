"""SGLang transfer backend `pd-shm`: PD KV through the shared-memory pool (transfer/shm_pool.py).

Over host_kv.py's SGLang contract and the room channel (transfer/shm_rooms.py):
- prefill: each `send(kv_indices)` gathers those KV pages (every layer's K and V item of a page:
  one pool slot) and publishes them; the last chunk also publishes the room's manifest with the
  request's metadata row (first output token and friends). Success once the manifest is out: the
  pool holds the pages (`PD_SHM_HOLD_S`), so the prefill frees its own KV at once and never waits
  for the decode.
- decode: `init` finds the prefill rank's pool in its bootstrap registry and checks that this
  engine maps the same pool; `poll` copies the pages once the manifest is there, checked by
  generation (and checksum, in a pool with checksums), then ends the prefill's hold.

Options: `ShmOptions` (transfer/options.py, PdShmConnector's too) from the environment, every
engine of a deployment alike: PD_SHM_POOL (path), PD_SHM_POOL_GB, PD_SHM_HOLD_S, PD_SHM_POOL_GROUP,
PD_SHM_REMOVE_WHEN_UNUSED, PD_VERIFY_KV; docs/connectors.md has their table.

Verified hand-off (issue 28, PD_VERIFY_KV, default `on`; transfer/shm_rooms.py): a pool this
engine creates has checksums, the manifest states every page's sum, and the decode uses a page
only if its bytes match the pool header, its slot kept its generation, and the header matches the
manifest; otherwise the room fails (KVPoll.Failed, "page N does not match what the prefill
published": SGLang aborts the request, pd-router retries it with a fresh prefill). A pool created
without checksums is refused under `required` and used `unverified` (counted, warned once) under
`on`. Fault injection (PD_KV_FAULTS, for tests, refused unless PD_KV_FAULTS_ALLOWED=1):
`flip_slot` on the prefill, `reuse` on the decode; rooms are matched as `room:<number>`.
"""

from __future__ import annotations

import logging

import numpy as np
from sglang.srt.disaggregation.utils import DisaggregationMode

from pd_plugins.connectors.sglang.host_kv import (
    HostKVManager,
    HostKVReceiver,
    HostKVSender,
    RegistryBootstrapServer,
    layout_of,
)
from pd_plugins.transfer.kv_faults import KvFaults
from pd_plugins.transfer.options import KvFaultOptions, ShmOptions, from_env
from pd_plugins.transfer.page_digests import PageChecks
from pd_plugins.transfer.shm_pool import PoolError, ShmKVPool
from pd_plugins.transfer.shm_rooms import RoomManifest, RoomReader, RoomTransferError, RoomWriter

logger = logging.getLogger("pd_plugins.sglang")

BACKEND_NAME = "pd-shm"
DEFAULT_POOL_PATH = "/dev/shm/pd-sglang-kv"


class PdShmKVManager(HostKVManager):
    backend_name = BACKEND_NAME

    def _open(self) -> None:
        options = from_env(ShmOptions, BACKEND_NAME)
        # refused (the engine does not start) unless PD_KV_FAULTS_ALLOWED=1, never in production
        self.faults = KvFaults.from_spec(from_env(KvFaultOptions, BACKEND_NAME).faults,
                                         f"{BACKEND_NAME} (SGLang)")
        self.checks = PageChecks()  # decode: what its receivers found
        self.verify = options.verify_kv
        path = options.pool_path or DEFAULT_POOL_PATH
        self.pool = ShmKVPool(path, slot_bytes=self.buffers.page_bytes,
                              layout=layout_of(self.kv_args), size_bytes=options.pool_size_bytes,
                              # verification needs the writers' sums; off: on for a DAX device
                              checksums=True if self.verify != "off" else None,
                              group=options.pool_group,
                              remove_when_unused=options.remove_when_unused)
        if self.verify != "off" and not self.pool.checksums:
            why = (f"pd-shm: pool {path} has no checksums, so its pages cannot be verified "
                   f"(`pd-pool remove {path}` while no engine uses it, then restart: a new pool "
                   "gets them)")
            if self.verify == "required":
                self.pool.close()
                raise PoolError(why + "; PD_VERIFY_KV is `required`")
            if self.mode == DisaggregationMode.DECODE:
                logger.warning("%s; rooms are used `unverified`", why)
        self.scope = f"{self.pool.pool_id}|{self.bootstrap_addr}|{self.rank_key}"
        self.writer = RoomWriter(self.pool, self.scope, options.hold_s, self.faults)

    def _record(self) -> dict:
        return {"pool_path": self.pool.path, "pool_id": self.pool.pool_id, "scope": self.scope}

    def close(self) -> None:
        self.pool.close()


class PdShmKVSender(HostKVSender):
    page_sums: list[np.ndarray]  # each chunk's pool checksums, for the manifest

    def _put_pages(self, pages: np.ndarray) -> None:
        rows = self.mgr.buffers.gather_pages(pages)
        sums = self.mgr.writer.put_pages(self.room, self.next_page, rows)
        self.page_sums = [*getattr(self, "page_sums", []), sums]
        self.bytes_moved += int(rows.nbytes)

    def _finish(self, aux: bytes) -> None:
        sums = getattr(self, "page_sums", [])
        self.mgr.writer.put_manifest(self.room, RoomManifest(
            num_pages=self.next_page, page_bytes=self.mgr.buffers.page_bytes, aux=aux),
            np.concatenate(sums) if sums else np.zeros(0, dtype=np.uint64))
        self._succeed()

    def _fail(self, exc: Exception) -> None:
        """A room that fails (a later chunk, the manifest) or is aborted before its manifest:
        the pages it published are never read, so their hold ends now, not after PD_SHM_HOLD_S
        (pages 0..next_page - 1 are this sender's own: a chunk whose publication failed is not
        counted, nor are a reused room's pages of another transfer)."""
        super()._fail(exc)
        if self.next_page:
            try:
                self.mgr.writer.release(self.room, self.next_page)
            except PoolError as release_error:  # best effort: the hold ends by itself
                logger.warning("pd-shm: room %d: its pages' hold not ended: %s", self.room,
                               release_error)


class PdShmKVReceiver(HostKVReceiver):
    kv_verdict: str | None = None  # verified / unverified once the KV is in (a mismatch fails)

    def _accept(self, record: dict) -> None:
        if record.get("pool_id") != self.mgr.pool.pool_id:
            raise RuntimeError(
                f"room {self.room}: the prefill at {self.prefill_addr} publishes into pool "
                f"{record.get('pool_path')} ({record.get('pool_id')}); this decode maps "
                f"{self.mgr.pool.path} ({self.mgr.pool.pool_id}). Give both engines the same "
                "PD_SHM_POOL on one host")
        self.reader = RoomReader(self.mgr.pool, record["scope"], self.mgr.verify, self.mgr.checks,
                                 self.mgr.faults, peer=self.prefill_addr)

    def _progress(self) -> None:
        manifest = self.reader.manifest(self.room)
        if manifest is None:
            return self._check_waiting()
        wanted = range(self.first_page, self.first_page + len(self.pages))
        if wanted.stop > manifest.num_pages:
            raise RoomTransferError(
                f"room {self.room}: the prefill published {manifest.num_pages} pages; this "
                f"decode needs pages {wanted.start}..{wanted.stop - 1}")
        rows = np.empty((len(self.pages), manifest.page_bytes), dtype=np.uint8)
        self.kv_verdict = self.reader.get_pages(self.room, list(wanted), rows, manifest)
        self.bytes_moved = int(rows.nbytes)
        self.mgr.buffers.scatter_pages(rows, self.pages)
        self.mgr.buffers.set_aux_row(self.aux_index, manifest.aux)
        self.reader.release(self.room, manifest.num_pages)
        self._succeed()


CLASSES = {"manager": PdShmKVManager, "sender": PdShmKVSender, "receiver": PdShmKVReceiver,
           "bootstrap_server": RegistryBootstrapServer}
