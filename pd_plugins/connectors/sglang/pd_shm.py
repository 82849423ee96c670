"""SGLang transfer backend `pd-shm`: PD KV through the shared-memory pool (transfer/shm_pool.py).

A thin adapter of SGLang's BaseKVManager / Sender / Receiver / BootstrapServer contract onto the
engine-agnostic room channel (transfer/shm_rooms.py) and bootstrap registry
(transfer/bootstrap_registry.py):

- prefill: each `send(kv_indices)` gathers those KV pages (every layer's K and V item of a page,
  one pool slot per page) and publishes them; the last chunk also publishes the room's manifest
  with the request's metadata-buffer row (first output token and friends). `poll` is Success once
  the manifest is out: the prefill's pages are held in the pool (`PD_SHM_HOLD_S`), so the prefill
  frees its own KV at once and never waits for the decode.
- decode: `init` finds the prefill rank's pool in its bootstrap registry and checks that this
  engine maps the same pool; `send_metadata` names the destination pages (after the decode's own
  cached prefix, `decode_prefix_len`); `poll` copies the pages once the manifest is there, checked
  by checksum and generation, then ends the prefill's hold.
- failures end in KVPoll.Failed with a reason from `failure_exception`: the prefill's registry
  unreachable for SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE checks in a row (a dead prefill),
  no manifest within SGLANG_DISAGGREGATION_WAITING_TIMEOUT, a page evicted or torn, abort.

Host (CPU) KV only: pages are read and written through numpy views of the engine's buffers.
Options (environment, every engine of a deployment alike): PD_SHM_POOL (path, default
/dev/shm/pd-sglang-kv), PD_SHM_POOL_GB (size when this engine creates it, default 1),
PD_SHM_HOLD_S (how long the prefill's pages are held for the decode, default 60).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from typing import Any, List, Optional

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs

from pd_plugins.transfer import bootstrap_registry
from pd_plugins.transfer.shm_pool import ShmKVPool
from pd_plugins.transfer.shm_rooms import RoomManifest, RoomReader, RoomTransferError, RoomWriter

logger = logging.getLogger("pd_plugins.sglang.pd_shm")

BACKEND_NAME = "pd-shm"


def _pool_options() -> tuple[str, int, float]:
    return (os.environ.get("PD_SHM_POOL", "/dev/shm/pd-sglang-kv"),
            int(float(os.environ.get("PD_SHM_POOL_GB", "1")) * 2**30),
            float(os.environ.get("PD_SHM_HOLD_S", "60")))


def _host_rows(ptr: int, length: int, item_len: int) -> np.ndarray:
    """A [items, item_len] uint8 view of one engine buffer (host memory only)."""
    raw = (ctypes.c_uint8 * length).from_address(ptr)
    return np.ctypeslib.as_array(raw).reshape(length // item_len, item_len)


class _Buffers:
    """The engine's KV buffers (one per layer and K/V) and metadata buffers, as row views."""

    def __init__(self, args: KVArgs) -> None:
        self.kv = [_host_rows(p, n, i) for p, n, i in
                   zip(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)]
        self.aux = [_host_rows(p, n, i) for p, n, i in
                    zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)]
        self.page_bytes = int(sum(args.kv_item_lens))

    def gather_pages(self, pages: np.ndarray) -> np.ndarray:
        return np.concatenate([buf[pages] for buf in self.kv], axis=1)

    def scatter_pages(self, rows: np.ndarray, pages: np.ndarray) -> None:
        offset = 0
        for buf in self.kv:
            width = buf.shape[1]
            buf[pages] = rows[:, offset:offset + width]
            offset += width

    def aux_row(self, index: int) -> bytes:
        return b"".join(buf[index].tobytes() for buf in self.aux)

    def set_aux_row(self, index: int, data: bytes) -> None:
        offset = 0
        for buf in self.aux:
            width = buf.shape[1]
            buf[index] = np.frombuffer(data[offset:offset + width], dtype=np.uint8)
            offset += width


def _layout(args: KVArgs) -> str:
    return (f"sglang|page={args.page_size}|dtype={getattr(args, 'kv_cache_dtype_str', '?')}"
            f"|items={','.join(map(str, args.kv_item_lens))}")


class PdShmKVManager(BaseKVManager):
    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: Optional[bool] = False) -> None:
        device = str(getattr(server_args, "device", "cpu") or "cpu")
        if not device.startswith("cpu"):
            raise NotImplementedError(f"{BACKEND_NAME} moves host KV only; this engine keeps its "
                                      f"KV on {device!r} (use pd-nixl or nixl there)")
        self.kv_args, self.mode, self.server_args = args, disaggregation_mode, server_args
        self.buffers = _Buffers(args)
        path, size, self.hold_s = _pool_options()
        self.pool = ShmKVPool(path, slot_bytes=self.buffers.page_bytes, layout=_layout(args),
                              size_bytes=size)
        host = getattr(server_args, "host", "127.0.0.1")
        self.bootstrap_addr = (f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}"
                               f":{server_args.disaggregation_bootstrap_port}")
        self.rank_key = bootstrap_registry.rank_key(getattr(args, "system_dp_rank", 0),
                                                    args.engine_rank)
        self.scope = f"{self.pool.pool_id}|{self.bootstrap_addr}|{self.rank_key}"
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.writer = RoomWriter(self.pool, self.scope, self.hold_s)
            self.register_to_bootstrap()

    def register_to_bootstrap(self) -> None:
        """The prefill rank's record: which pool (path, id) and scope its rooms are in."""
        record = {"backend": BACKEND_NAME, "pool_path": self.pool.path,
                  "pool_id": self.pool.pool_id, "scope": self.scope,
                  "page_bytes": self.buffers.page_bytes, "page_size": self.kv_args.page_size}
        deadline = time.monotonic() + 30  # the registry may start just after this rank
        while True:
            try:
                return bootstrap_registry.register(self.bootstrap_addr, self.rank_key, record)
            except bootstrap_registry.RegistryUnreachable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def close(self) -> None:
        self.pool.close()


class PdShmKVSender(BaseKVSender):
    def __init__(self, mgr: PdShmKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self.mgr, self.room = mgr, int(bootstrap_room)
        self.state = KVPoll.WaitingForInput  # no handshake: the pool decouples the two sides
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.next_page = 0
        self.bytes_sent = 0
        self.started: float | None = None
        self.elapsed_s: float | None = None
        self.error: Exception | None = None

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk  # an empty last chunk still publishes the manifest

    def send(self, kv_indices: np.ndarray, state_indices: Optional[List] = None,
             num_kv_tokens: Optional[int] = None) -> None:
        if self.state != KVPoll.WaitingForInput and self.state != KVPoll.Transferring:
            return
        if self.num_pages is None:
            return self._fail(RuntimeError(f"room {self.room}: send() before init()"))
        if state_indices and any(s is not None for s in state_indices):
            return self._fail(NotImplementedError(
                f"{BACKEND_NAME} moves paged KV only, not state buffers (Mamba, SWA, ...)"))
        self.started = self.started or time.perf_counter()
        self.state = KVPoll.Transferring
        pages = np.asarray(kv_indices, dtype=np.int64)
        try:
            if pages.size:
                self.bytes_sent += self.mgr.writer.put_pages(
                    self.room, self.next_page, self.mgr.buffers.gather_pages(pages))
                self.next_page += int(pages.size)
            if self.next_page >= self.num_pages:
                aux = (self.mgr.buffers.aux_row(self.aux_index)
                       if self.aux_index is not None and self.aux_index >= 0 else b"")
                self.mgr.writer.put_manifest(self.room, RoomManifest(
                    num_pages=self.next_page, page_bytes=self.mgr.buffers.page_bytes, aux=aux))
                self.elapsed_s = time.perf_counter() - self.started
                self.state = KVPoll.Success
        except (RoomTransferError, OSError) as exc:
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        logger.warning("%s sender, room %d: %s", BACKEND_NAME, self.room, exc)
        self.error, self.state = exc, KVPoll.Failed

    def poll(self) -> int:
        return self.state

    def failure_exception(self):
        raise self.error or RuntimeError(f"{BACKEND_NAME} sender for room {self.room} failed")

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric(transfer_latency_s=self.elapsed_s,
                                transfer_total_bytes=self.bytes_sent)

    def abort(self) -> None:
        if self.state != KVPoll.Success:
            self._fail(RuntimeError(f"room {self.room}: aborted"))


class PdShmKVReceiver(BaseKVReceiver):
    def __init__(self, mgr: PdShmKVManager, bootstrap_addr: str,
                 bootstrap_room: Optional[int] = None) -> None:
        self.mgr, self.prefill_addr, self.room = mgr, bootstrap_addr, int(bootstrap_room or 0)
        self.state = KVPoll.Bootstrapping
        self.reader: RoomReader | None = None
        self.pages: np.ndarray | None = None
        self.first_page = 0
        self.aux_index: int | None = None
        self.error: Exception | None = None
        self.prefill_dp_rank = 0
        now = time.monotonic()
        self.bootstrap_deadline = now + envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
        self.waiting_deadline: float | None = None
        self.heartbeat_s = envs.SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL.get()
        self.max_heartbeat_failures = envs.SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE.get()
        self.next_heartbeat = now + self.heartbeat_s
        self.heartbeat_failures = 0
        self.elapsed_s: float | None = None
        self.bytes_read = 0

    def init(self, prefill_dp_rank: int) -> None:
        self.prefill_dp_rank = int(prefill_dp_rank)
        self._bootstrap()

    def _bootstrap(self) -> None:
        key = bootstrap_registry.rank_key(self.prefill_dp_rank, self.mgr.kv_args.engine_rank)
        try:
            record = bootstrap_registry.lookup(self.prefill_addr, key)
        except (bootstrap_registry.RegistryUnreachable, RuntimeError) as exc:
            record, reason = None, str(exc)
        else:
            reason = f"prefill rank {key} has not registered at {self.prefill_addr}"
        if record is None:
            if time.monotonic() > self.bootstrap_deadline:
                self._fail(TimeoutError(f"room {self.room}: bootstrap timed out: {reason}"))
            return
        if record.get("backend") != BACKEND_NAME or record.get("pool_id") != self.mgr.pool.pool_id:
            return self._fail(RuntimeError(
                f"room {self.room}: the prefill at {self.prefill_addr} publishes into "
                f"{record.get('backend')} pool {record.get('pool_path')} "
                f"({record.get('pool_id')}); this decode maps {self.mgr.pool.path} "
                f"({self.mgr.pool.pool_id}). Give both engines the same PD_SHM_POOL on one host"))
        self.reader = RoomReader(self.mgr.pool, record["scope"])
        self.state = KVPoll.WaitingForInput

    def send_metadata(self, kv_indices: np.ndarray, aux_index: Optional[int] = None,
                      state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None, destination: Any = None,
                      **_: Any) -> None:
        if self.state != KVPoll.WaitingForInput:
            return
        if state_indices and any(s is not None for s in state_indices):
            return self._fail(NotImplementedError(
                f"{BACKEND_NAME} moves paged KV only, not state buffers (Mamba, SWA, ...)"))
        if destination is not None and getattr(destination, "value", destination) != "device":
            return self._fail(NotImplementedError(f"{BACKEND_NAME}: host destinations"))
        self.pages = np.asarray(kv_indices, dtype=np.int64)
        self.first_page = int(decode_prefix_len or 0) // self.mgr.kv_args.page_size
        self.aux_index = aux_index
        self.waiting_deadline = time.monotonic() + envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()
        self.started = time.perf_counter()
        self.state = KVPoll.Transferring

    def poll(self) -> int:
        if self.state == KVPoll.Bootstrapping:
            self._bootstrap()
        elif self.state == KVPoll.Transferring:
            try:
                self._try_receive()
            except (RoomTransferError, OSError) as exc:
                self._fail(exc)
        return self.state

    def _try_receive(self) -> None:
        manifest = self.reader.manifest(self.room)
        if manifest is None:
            return self._check_prefill_alive()
        wanted = range(self.first_page, self.first_page + len(self.pages))
        if manifest.page_bytes != self.mgr.buffers.page_bytes or wanted.stop > manifest.num_pages:
            raise RoomTransferError(
                f"room {self.room}: the prefill published {manifest.num_pages} pages of "
                f"{manifest.page_bytes} bytes; this decode needs pages {wanted.start}.."
                f"{wanted.stop - 1} of {self.mgr.buffers.page_bytes} bytes")
        rows = np.empty((len(self.pages), manifest.page_bytes), dtype=np.uint8)
        self.bytes_read = self.reader.get_pages(self.room, list(wanted), rows)
        self.mgr.buffers.scatter_pages(rows, self.pages)
        if self.aux_index is not None and self.aux_index >= 0 and manifest.aux:
            self.mgr.buffers.set_aux_row(self.aux_index, manifest.aux)
        self.reader.release(self.room, manifest.num_pages)
        self.elapsed_s = time.perf_counter() - self.started
        self.state = KVPoll.Success

    def _check_prefill_alive(self) -> None:
        now = time.monotonic()
        if now > self.waiting_deadline:
            return self._fail(TimeoutError(
                f"room {self.room}: no KV from the prefill at {self.prefill_addr} within "
                f"{envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()} s"))
        if now < self.next_heartbeat:
            return
        self.next_heartbeat = now + self.heartbeat_s
        if bootstrap_registry.is_alive(self.prefill_addr):
            self.heartbeat_failures = 0
            return
        self.heartbeat_failures += 1
        if self.heartbeat_failures >= self.max_heartbeat_failures:
            self._fail(ConnectionError(
                f"room {self.room}: the prefill at {self.prefill_addr} is gone (its bootstrap "
                f"registry missed {self.heartbeat_failures} heartbeats)"))

    def _fail(self, exc: Exception) -> None:
        logger.warning("%s receiver, room %d: %s", BACKEND_NAME, self.room, exc)
        self.error, self.state = exc, KVPoll.Failed

    def failure_exception(self):
        raise self.error or RuntimeError(f"{BACKEND_NAME} receiver for room {self.room} failed")

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric(transfer_latency_s=self.elapsed_s,
                                transfer_total_bytes=self.bytes_read)

    def abort(self) -> None:
        if self.state != KVPoll.Success:
            self._fail(RuntimeError(f"room {self.room}: aborted"))


class PdShmKVBootstrapServer(BaseKVBootstrapServer):
    """The prefill instance's bootstrap registry (transfer/bootstrap_registry.py)."""

    def __init__(self, host: str, port: int) -> None:
        self.registry = bootstrap_registry.BootstrapRegistry(host, port)

    def close(self) -> None:
        self.registry.close()


CLASSES = {"manager": PdShmKVManager, "sender": PdShmKVSender, "receiver": PdShmKVReceiver,
           "bootstrap_server": PdShmKVBootstrapServer}
