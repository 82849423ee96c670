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
PD_SHM_REMOVE_WHEN_UNUSED; docs/connectors.md has their table.
"""

from __future__ import annotations

import numpy as np

from pd_plugins.connectors.sglang.host_kv import (
    HostKVManager,
    HostKVReceiver,
    HostKVSender,
    RegistryBootstrapServer,
    layout_of,
)
from pd_plugins.transfer.options import ShmOptions, from_env
from pd_plugins.transfer.shm_pool import ShmKVPool
from pd_plugins.transfer.shm_rooms import RoomManifest, RoomReader, RoomTransferError, RoomWriter

BACKEND_NAME = "pd-shm"
DEFAULT_POOL_PATH = "/dev/shm/pd-sglang-kv"


class PdShmKVManager(HostKVManager):
    backend_name = BACKEND_NAME

    def _open(self) -> None:
        options = from_env(ShmOptions, BACKEND_NAME)
        self.pool = ShmKVPool(options.pool_path or DEFAULT_POOL_PATH,
                              slot_bytes=self.buffers.page_bytes,
                              layout=layout_of(self.kv_args), size_bytes=options.pool_size_bytes,
                              checksums=None,  # on for a DAX device, off for a file
                              group=options.pool_group,
                              remove_when_unused=options.remove_when_unused)
        self.scope = f"{self.pool.pool_id}|{self.bootstrap_addr}|{self.rank_key}"
        self.writer = RoomWriter(self.pool, self.scope, options.hold_s)

    def _record(self) -> dict:
        return {"pool_path": self.pool.path, "pool_id": self.pool.pool_id, "scope": self.scope}

    def close(self) -> None:
        self.pool.close()


class PdShmKVSender(HostKVSender):
    def _put_pages(self, pages: np.ndarray) -> None:
        self.bytes_moved += self.mgr.writer.put_pages(self.room, self.next_page,
                                                      self.mgr.buffers.gather_pages(pages))

    def _finish(self, aux: bytes) -> None:
        self.mgr.writer.put_manifest(self.room, RoomManifest(
            num_pages=self.next_page, page_bytes=self.mgr.buffers.page_bytes, aux=aux))
        self._succeed()


class PdShmKVReceiver(HostKVReceiver):
    def _accept(self, record: dict) -> None:
        if record.get("pool_id") != self.mgr.pool.pool_id:
            raise RuntimeError(
                f"room {self.room}: the prefill at {self.prefill_addr} publishes into pool "
                f"{record.get('pool_path')} ({record.get('pool_id')}); this decode maps "
                f"{self.mgr.pool.path} ({self.mgr.pool.pool_id}). Give both engines the same "
                "PD_SHM_POOL on one host")
        self.reader = RoomReader(self.mgr.pool, record["scope"])

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
        self.bytes_moved = self.reader.get_pages(self.room, list(wanted), rows)
        self.mgr.buffers.scatter_pages(rows, self.pages)
        self.mgr.buffers.set_aux_row(self.aux_index, manifest.aux)
        self.reader.release(self.room, manifest.num_pages)
        self._succeed()


CLASSES = {"manager": PdShmKVManager, "sender": PdShmKVSender, "receiver": PdShmKVReceiver,
           "bootstrap_server": RegistryBootstrapServer}
