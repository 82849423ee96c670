"""What pd-plugins' SGLang backends share: SGLang's KV manager / sender / receiver / bootstrap
server contract over the engine's KV buffers and the bootstrap registry
(transfer/bootstrap_registry.py).

KV buffers are in host memory (`--device cpu`) or, for a backend whose transport moves device
memory itself (`device_kv`: pd-nixl), on a CUDA GPU; other backends refuse a CUDA engine. The
metadata buffers are host memory either way (SGLang allocates them on the CPU).

A backend subclasses the three classes and supplies the transfer itself:
- manager `_open()` (set up its transport) and `_record()` (what the prefill rank registers);
- sender `_put_pages(pages)` per chunk and `_finish(aux)` after the last one, and optionally
  `_progress()` while it waits for the decode (pull backends);
- receiver `_accept(record)` (the prefill rank's record; raise to refuse it) and `_progress()`,
  called by `poll` while transferring (set `self.state = KVPoll.Success` when done).

Shared behaviour: the lifecycle states SGLang's schedulers poll, page numbering after the decode's
cached prefix (`decode_prefix_len`), the metadata row (first output token) carried beside the KV,
timeouts from SGLang's own environment (bootstrap, waiting, heartbeat), a dead prefill detected
by its registry missing heartbeats, and every failure ending in KVPoll.Failed with a reason.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
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
from sglang.srt.disaggregation.common.conn import PrefillServerInfo
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs

from pd_plugins.transfer import bootstrap_registry
from pd_plugins.transfer.nixl_rooms import HOST, Memory

logger = logging.getLogger("pd_plugins.sglang")

# What a room's work raises when a transfer fails or a peer's record (the bootstrap registry's
# rank record, a decode's push target) is malformed: a missing field (KeyError), a field of the
# wrong type or shape (TypeError, ValueError, IndexError). Each fails that room; escaping poll()
# or send() would stop SGLang's scheduler, and the engine with it. (Our own bugs raise the last
# three too: _fail logs their traceback.)
ROOM_FAULTS = (RuntimeError, OSError, ValueError, KeyError, TypeError, IndexError)

# A decode's calls to the prefill's registry run on SGLang's scheduler thread, at the address the
# request names (`bootstrap_host`, `bootstrap_port`): each may take this long in all, and after
# one that stalled (no answer in time, or more than a registry answers) the receiver asks that
# registry nothing for a heartbeat interval; HEARTBEAT_MAX_FAILURE stalls in a row fail the room.
# So an address that stalls costs the scheduler at most HEARTBEAT_MAX_FAILURE x REGISTRY_CALL_S
# per room (docs/security.md).
REGISTRY_CALL_S = 1.0
# The decode manager's first contact with an address (try_ensure_parallel_info, which SGLang calls
# on its scheduler thread about once a second, 15 times, for each address its new requests name)
# keeps the same rules per address; once an address stalled out it is not asked for this long
# (SGLang has aborted that address's requests by then), so an address that stalls for good costs
# the scheduler at most HEARTBEAT_MAX_FAILURE x REGISTRY_CALL_S per this interval.
PARALLEL_INFO_STALLED_OUT_S = 30.0
# How many addresses the decode manager remembers a failure or a run of stalls for (the least
# recently failing are forgotten first): the request names the address, so a client could name
# any number.
PARALLEL_INFO_ADDRESSES = 4096


class _Recent(OrderedDict):
    """A dict that keeps its `limit` most recently set keys."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


def host_rows(ptr: int, length: int, item_len: int) -> np.ndarray:
    """A [items, item_len] uint8 view of one engine buffer (host memory only)."""
    raw = (ctypes.c_uint8 * length).from_address(ptr)
    return np.ctypeslib.as_array(raw).reshape(length // item_len, item_len)


def _runtime_config(namespace: str) -> Any:
    """A namespace of SGLang's runtime config (published by its scheduler), or None outside one."""
    try:
        from sglang.srt import runtime_context
        return getattr(runtime_context, f"get_{namespace}")()
    except (ImportError, AttributeError, ValueError):
        return None


def engine_device(server_args: Any) -> str:
    """The device SGLang runs on: the one it resolved (`--device` may be omitted: SGLang detects
    it, and `server_args.device` then stays None), else `--device`, else what torch sees."""
    resolved = getattr(_runtime_config("device"), "device", None)
    device = resolved or getattr(server_args, "device", None)
    if not device:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def attention_tp_size(server_args: Any) -> int:
    """How many ranks split one request's KV heads (SGLang's attention TP: the TP size, divided
    by the DP size under DP attention). pd-shm and pd-nixl pair prefill rank k with decode rank k,
    so both sides must have the same."""
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    if getattr(server_args, "enable_dp_attention", False):
        tp //= max(1, int(getattr(server_args, "dp_size", 1) or 1))
    return max(1, tp)


def kv_memory_of(server_args: Any, args: KVArgs) -> Memory:
    """The KV's memory from the engine's device (the metadata buffers stay in host memory: SGLang
    allocates them on the CPU unless Mooncake's NVLink pool is configured)."""
    if getattr(_runtime_config("memory"), "enable_hisparse", False):
        # the decode then transfers through a host pool beside its device pool
        raise NotImplementedError("pd-plugins' SGLang backends do not support --enable-hisparse")
    device = engine_device(server_args)
    if device.startswith("cpu"):
        return HOST
    if device.startswith("cuda"):
        return Memory("VRAM", int(getattr(args, "gpu_id", 0) or 0))
    raise NotImplementedError(f"pd-plugins' SGLang backends move KV in host or CUDA memory, not "
                              f"on {device!r}")


class EngineBuffers:
    """The engine's KV buffers (one per layer and K/V) as (address, bytes, page bytes), and its
    metadata buffers as host row views. KV row views (`kv`) exist only for host KV: device KV is
    only ever addressed, by a transport that reads and writes device memory itself (NIXL)."""

    def __init__(self, args: KVArgs, memory: Memory = HOST) -> None:
        self.memory = memory
        self.items = [(int(p), int(n), int(i)) for p, n, i in
                      zip(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)]
        self.kv = [host_rows(p, n, i) for p, n, i in self.items] if memory.on_host else []
        self.aux = [host_rows(p, n, i) for p, n, i in
                    zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)]
        self.page_bytes = int(sum(args.kv_item_lens))

    def regions(self) -> list[tuple[int, int]]:
        return [(ptr, length) for ptr, length, _ in self.items]

    @property
    def num_pages(self) -> int:
        """Pages each KV buffer holds (the most any room or target can name)."""
        return min((length // width for _, length, width in self.items), default=0)

    def page_items(self) -> list[tuple[int, int]]:
        """(address, page bytes) of each KV buffer: page p of a buffer starts at address + p x bytes."""
        return [(ptr, width) for ptr, _, width in self.items]

    def page_ranges(self, pages) -> list[tuple[int, int]]:
        """(address, length) of every page in every KV buffer, buffer by buffer."""
        return page_ranges(self.page_items(), pages)

    def gather_pages(self, pages: np.ndarray) -> np.ndarray:
        return np.concatenate([buf[pages] for buf in self._host_kv()], axis=1)

    def scatter_pages(self, rows: np.ndarray, pages: np.ndarray) -> None:
        offset = 0
        for buf in self._host_kv():
            width = buf.shape[1]
            buf[pages] = rows[:, offset:offset + width]
            offset += width

    def _host_kv(self) -> list[np.ndarray]:
        if not self.memory.on_host:
            raise RuntimeError(f"the KV is in {self.memory.kind} memory: no host copy of its pages")
        return self.kv

    def aux_row(self, index: int | None) -> bytes:
        if index is None or index < 0:
            return b""
        return b"".join(buf[index].tobytes() for buf in self.aux)

    def set_aux_row(self, index: int | None, data: bytes) -> None:
        if index is None or index < 0 or not data:
            return
        offset = 0
        for buf in self.aux:
            width = buf.shape[1]
            buf[index] = np.frombuffer(data[offset:offset + width], dtype=np.uint8)
            offset += width


def page_ranges(items: list[tuple[int, int]], pages) -> list[tuple[int, int]]:
    """(address, length) of every page in every buffer of `items` ((address, page bytes) each),
    buffer by buffer."""
    return [(addr + int(p) * width, width) for addr, width in items for p in pages]


def _setting(server_args: Any, name: str, default: Any) -> Any:
    value = getattr(server_args, name, None)
    return default if value is None else value


def dp_layout(server_args: Any) -> tuple[int, int]:
    """(DP replicas, attention-DP size) of an engine. `--dp-size N --enable-dp-attention` (the
    deprecated spelling) is attention DP: SGLang resolves it to `attn_dp_size = N, dp_size = 1`;
    unresolved server args still read `dp_size = N` with the flag."""
    replicas = int(_setting(server_args, "dp_size", 1))
    attention = int(_setting(server_args, "attn_dp_size", 1))
    if _setting(server_args, "enable_dp_attention", False) and replicas > 1:
        replicas, attention = 1, max(attention, replicas)
    return max(1, replicas), max(1, attention)


def unservable(server_args: Any, mode: DisaggregationMode) -> str | None:
    """Why pd-shm and pd-nixl cannot serve this engine's configuration (None: they can).

    They pair prefill rank (DP replica d, TP rank k) with decode rank (d', k) through the bootstrap
    registry's rank records, and a decode finds a room's prefill DP replica from the room number
    alone (SGLang's follow_bootstrap_room): no room-to-rank table, no CP or PP stage in the key,
    no prefill-side allocation handshake."""
    replicas, attention_dp = dp_layout(server_args)
    if attention_dp > 1:
        return (f"attention DP (--attn-dp-size {attention_dp}, or --dp-size with "
                "--enable-dp-attention) is not supported: ranks are paired by DP replica and TP "
                "rank only (--dp-size replicas are supported)")
    if int(_setting(server_args, "attn_cp_size", 1)) > 1:
        return "attention context parallelism (--attn-cp-size > 1) is not supported"
    if int(_setting(server_args, "pp_size", 1)) > 1:
        return "pipeline parallelism (--pp-size > 1) is not supported"
    policy = _setting(server_args, "disaggregation_decode_allocation_policy", "early")
    if policy != "early":
        return (f"--disaggregation-decode-allocation-policy {policy} is not supported (only "
                "`early`: the prefill never waits for the decode)")
    if envs.SGLANG_DISAGG_STAGING_BUFFER.get():
        return "SGLANG_DISAGG_STAGING_BUFFER (heterogeneous-TP staging) is not supported"
    if envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get():
        return ("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK is not supported: the "
                "bootstrap registry keeps no room-to-DP-rank table; a decode finds a room's "
                "prefill DP rank from the room number (follow_bootstrap_room)")
    balance = _setting(server_args, "load_balance_method", "auto")
    if (mode == DisaggregationMode.PREFILL and replicas > 1
            and balance not in ("auto", "follow_bootstrap_room")):
        return (f"a prefill of {replicas} DP replicas must place rooms by "
                f"--load-balance-method follow_bootstrap_room (SGLang's default for a prefill), "
                f"not {balance}: the decode finds a room's DP rank from the room number")
    return None


def prefill_info(record: dict, page_size: int) -> PrefillServerInfo:
    """SGLang's PrefillServerInfo for a prefill, from its rank 0 registry record: what SGLang's
    decode queue reads to route a room to a prefill DP rank (room % dp_size). A record without
    `dp_size` (a pd-plugins prefill from before it was published) is one DP rank."""
    dp_size, tp_size = record.get("dp_size", 1), record.get("tp_size", 1)
    for name, value in (("dp_size", dp_size), ("tp_size", tp_size)):
        if type(value) is not int or not 1 <= value <= bootstrap_registry.MAX_RANKS:
            raise ValueError(f"the prefill's record has {name} {value!r}")
    return PrefillServerInfo(
        attn_tp_size=tp_size, attn_cp_size=1, dp_size=dp_size, pp_size=1,
        page_size=record.get("page_size") if type(record.get("page_size")) is int else page_size,
        kv_cache_dtype=None,
        # a pd-plugins prefill of several DP replicas runs follow_bootstrap_room (unservable())
        follow_bootstrap_room=True)


def layout_of(args: KVArgs) -> str:
    return (f"sglang|page={args.page_size}|dtype={getattr(args, 'kv_cache_dtype_str', '?')}"
            f"|items={','.join(map(str, args.kv_item_lens))}")


class HostKVManager(BaseKVManager):
    backend_name = "?"
    device_kv = False  # whether the transport reads and writes device (CUDA) memory itself

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: Optional[bool] = False) -> None:
        # SGLang fills these before it builds the manager: a model whose KV has state beside its
        # pages (Mamba, sliding-window rings, DSA, ...) is refused here, at the engine's start,
        # rather than at each request (`_refuse_states`)
        states = [getattr(kind, "value", str(kind)) for kind in getattr(args, "state_types", None)
                  or ()]
        if states:
            raise NotImplementedError(
                f"{self.backend_name} moves paged KV only; this model's KV also has state "
                f"buffers ({', '.join(states)}): use SGLang's own mooncake or nixl transfer "
                "backend for it")
        refused = unservable(server_args, disaggregation_mode)
        if refused:
            raise NotImplementedError(f"{self.backend_name}: {refused}; use SGLang's own "
                                      "mooncake or nixl transfer backend for it")
        memory = kv_memory_of(server_args, args)
        if not memory.on_host and not self.device_kv:
            raise NotImplementedError(
                f"{self.backend_name} moves host KV only; this engine keeps its KV on "
                f"{engine_device(server_args)!r} (pd-nixl moves CUDA KV)")
        self.kv_args, self.mode, self.server_args = args, disaggregation_mode, server_args
        self.buffers = EngineBuffers(args, memory)
        # where this instance's registry listens (PD_BOOTSTRAP_HOST, else --host)
        self.bootstrap_addr = bootstrap_registry.local_address(
            getattr(server_args, "host", None), server_args.disaggregation_bootstrap_port)
        # SGLang passes system_dp_rank None when no data-parallel controller runs (most engines)
        self.dp_rank = int(getattr(args, "system_dp_rank", None) or 0)
        self.dp_size = dp_layout(server_args)[0]
        self.rank_key = bootstrap_registry.rank_key(self.dp_rank, args.engine_rank)
        # decode: what SGLang's DecodePreallocQueue reads for every new request to route its room
        # to a prefill DP rank (try_ensure_parallel_info fills it), and why an address has none
        self.prefill_info_table: dict[str, PrefillServerInfo] = {}
        self.parallel_info_errors: dict[str, str] = _Recent(PARALLEL_INFO_ADDRESSES)
        # per address: [stalls in a row, monotonic time before which it is not asked]
        self._parallel_info_stalls: dict[str, list] = _Recent(PARALLEL_INFO_ADDRESSES)
        self._heartbeat_s = envs.SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL.get()
        self._max_stalls = envs.SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE.get()
        self._prefill_recompute_executor: ThreadPoolExecutor | None = None
        self._open()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.register_to_bootstrap()

    def _open(self) -> None:
        raise NotImplementedError

    def _record(self) -> dict:
        raise NotImplementedError

    def register_to_bootstrap(self) -> None:
        record = {"backend": self.backend_name, "page_bytes": self.buffers.page_bytes,
                  "page_size": self.kv_args.page_size, "dp_size": self.dp_size,
                  "tp_size": attention_tp_size(self.server_args), **self._record()}
        deadline = time.monotonic() + 30  # the registry may start just after this rank
        while True:
            try:
                return bootstrap_registry.register(self.bootstrap_addr, self.rank_key, record)
            except bootstrap_registry.RegistryUnreachable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    # -- what SGLang's decode queue calls on its KV manager (decode.py, DecodePreallocQueue) --------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """One attempt to learn the prefill at `bootstrap_addr`'s DP size (its rank 0 record);
        False until it has registered. SGLang retries about once a second and aborts the
        address's requests after 15 failures (their receivers then say why). The receiver's
        rules for a registry that stalls hold per address (see PARALLEL_INFO_STALLED_OUT_S):
        nothing is asked for a heartbeat interval after a stalled call, and after
        HEARTBEAT_MAX_FAILURE stalls in a row nothing for PARALLEL_INFO_STALLED_OUT_S."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        key = bootstrap_registry.rank_key(0, 0)
        stalls = self._parallel_info_stalls.get(bootstrap_addr)
        now = time.monotonic()
        if stalls is not None and now < stalls[1]:
            return False  # quiet after a stall: its reason is in parallel_info_errors
        if stalls is not None and stalls[0] >= self._max_stalls:
            del self._parallel_info_stalls[bootstrap_addr]  # stalled out long enough ago
        try:
            # on SGLang's scheduler thread, at the address the request names: a short call
            record = bootstrap_registry.lookup(bootstrap_addr, key, timeout_s=REGISTRY_CALL_S)
            self._parallel_info_stalls.pop(bootstrap_addr, None)  # an answer ends the stalls
            if record is None:
                reason = f"prefill rank {key} has not registered at {bootstrap_addr}"
            else:
                self.prefill_info_table[bootstrap_addr] = prefill_info(
                    record, self.kv_args.page_size)
                self.parallel_info_errors.pop(bootstrap_addr, None)
                return True
        except bootstrap_registry.RegistryStalled as exc:
            stalls = self._parallel_info_stalls.get(bootstrap_addr) or [0, 0.0]
            stalls[0] += 1
            if stalls[0] >= self._max_stalls:
                stalls[1] = time.monotonic() + PARALLEL_INFO_STALLED_OUT_S
                reason = (f"the bootstrap registry at {bootstrap_addr} stalled {stalls[0]} calls "
                          f"in a row (no answer within {REGISTRY_CALL_S:g} s, or more than a "
                          f"registry answers); not asked for {PARALLEL_INFO_STALLED_OUT_S:g} s")
            else:
                stalls[1] = time.monotonic() + self._heartbeat_s
                reason = f"{type(exc).__name__}: {exc}"
            self._parallel_info_stalls[bootstrap_addr] = stalls
        except (bootstrap_registry.RegistryUnreachable, RuntimeError, ValueError,
                TypeError) as exc:  # RegistryAuthError is a RuntimeError
            reason = f"{type(exc).__name__}: {exc}"
        if self.parallel_info_errors.get(bootstrap_addr) != reason:
            logger.warning("%s: no parallel info from the prefill at %s yet: %s",
                           self.backend_name, bootstrap_addr, reason)
        self.parallel_info_errors[bootstrap_addr] = reason
        return False

    def _ensure_prefill_recompute_executor(self) -> ThreadPoolExecutor:
        """SGLang submits its room-to-DP-rank queries here (only for a room whose DP rank the
        room number does not give: never with a pd-plugins prefill, see unservable())."""
        if self._prefill_recompute_executor is None:
            self._prefill_recompute_executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"{self.backend_name}-dp-rank-query")
        return self._prefill_recompute_executor

    def submit_prefill_recompute(self, kv_receiver: "HostKVReceiver", payload: dict) -> None:
        """SGLang's PD retract rebootstrap (a retracted request's prefix recomputed on its
        prefill under new weights) is not supported: the room fails, so SGLang aborts the
        request with this reason."""
        kv_receiver.abort()
        kv_receiver.error = NotImplementedError(
            f"room {kv_receiver.room}: {self.backend_name} cannot have the prefill recompute a "
            "retracted request's prefix (SGLang's PD retract rebootstrap); the request is aborted")
        logger.warning("%s", kv_receiver.error)


class _Outcome:
    """State, failure reason and timing of one sender or receiver."""

    state: int
    error: Exception | None = None
    room: int = 0
    started: float | None = None
    elapsed_s: float | None = None
    bytes_moved: int = 0

    def _fail(self, exc: Exception) -> None:
        # A malformed peer record and a bug of ours both raise these: the room fails either
        # way (the engine lives on), with the traceback in the log so a bug stays visible.
        where = exc if isinstance(exc, (KeyError, TypeError, IndexError)) else None
        if isinstance(exc, KeyError):  # str() of a KeyError is the bare key
            exc = RuntimeError(f"room {self.room}: a record without its field {exc}")
        logger.warning("%s %s, room %d: %s", self.mgr.backend_name, type(self).__name__,
                       self.room, exc, exc_info=where)
        self.error, self.state = exc, KVPoll.Failed

    def _succeed(self) -> None:
        self.elapsed_s = time.perf_counter() - (self.started or time.perf_counter())
        self.state = KVPoll.Success

    def failure_exception(self):
        raise self.error or RuntimeError(f"{self.mgr.backend_name}: room {self.room} failed")

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric(transfer_latency_s=self.elapsed_s,
                                transfer_total_bytes=self.bytes_moved)

    def abort(self) -> None:
        if self.state != KVPoll.Success:
            self._fail(RuntimeError(f"room {self.room}: aborted"))


def _refuse_states(state_indices: Optional[List], backend: str) -> Exception | None:
    if state_indices and any(s is not None for s in state_indices):
        return NotImplementedError(f"{backend} moves paged KV only, not state buffers "
                                   "(Mamba, SWA, ...)")
    return None


class HostKVSender(_Outcome, BaseKVSender):
    def __init__(self, mgr: HostKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self.mgr, self.room = mgr, int(bootstrap_room)
        self.kv_mgr = mgr  # SGLang's name for it (prefill.py reads it)
        self.state = KVPoll.WaitingForInput  # no handshake before the prefill runs
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.next_page = 0
        implied = self.room % mgr.dp_size
        if mgr.dp_size > 1 and not req_has_disagg_prefill_dp_rank and implied != mgr.dp_rank:
            # the decode looks for the room on the DP rank its number implies (as SGLang's own
            # backends check): a request routed elsewhere (routed_dp_rank) would never be found
            self._fail(RuntimeError(
                f"room {self.room}: dispatched to prefill DP rank {mgr.dp_rank}, but the decode "
                f"looks for it on DP rank {implied} (room % {mgr.dp_size}, "
                "follow_bootstrap_room); route it there or pass disagg_prefill_dp_rank"))

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk  # an empty last chunk still completes the room

    def send(self, kv_indices: np.ndarray, state_indices: Optional[List] = None,
             num_kv_tokens: Optional[int] = None) -> None:
        if self.state not in (KVPoll.WaitingForInput, KVPoll.Transferring):
            return
        if self.num_pages is None:
            return self._fail(RuntimeError(f"room {self.room}: send() before init()"))
        refused = _refuse_states(state_indices, self.mgr.backend_name)
        if refused:
            return self._fail(refused)
        self.started = self.started or time.perf_counter()
        self.state = KVPoll.Transferring
        pages = np.asarray(kv_indices, dtype=np.int64)
        try:
            if pages.size:
                self._put_pages(pages)
                self.next_page += int(pages.size)
            if self.next_page >= self.num_pages:
                self._finish(self.mgr.buffers.aux_row(self.aux_index))
        except ROOM_FAULTS as exc:
            self._fail(exc)

    def poll(self) -> int:
        if self.state == KVPoll.Transferring and self.next_page >= (self.num_pages or 0):
            try:
                self._progress()
            except ROOM_FAULTS as exc:
                self._fail(exc)
        return self.state

    def _put_pages(self, pages: np.ndarray) -> None:
        raise NotImplementedError

    def _finish(self, aux: bytes) -> None:
        raise NotImplementedError

    def _progress(self) -> None:
        pass


class HostKVReceiver(_Outcome, BaseKVReceiver):
    require_staging = False  # SGLang's decode reads it (no staging buffer: unservable())

    def __init__(self, mgr: HostKVManager, bootstrap_addr: str,
                 bootstrap_room: Optional[int] = None) -> None:
        self.mgr, self.prefill_addr, self.room = mgr, bootstrap_addr, int(bootstrap_room or 0)
        # what SGLang's decode queue reads of every receiver (decode.py pop_transferred, for a
        # failed room): without them its AttributeError stopped the scheduler, the engine too
        self.kv_mgr, self.abort_notified = mgr, False
        self.state = KVPoll.Bootstrapping
        self.pages: np.ndarray | None = None
        self.first_page = 0
        self.aux_index: int | None = None
        self.prefill_dp_rank = 0
        self.initialised = False  # SGLang calls init once it knows the prefill DP rank
        now = time.monotonic()
        self.bootstrap_deadline = now + envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
        self.waiting_deadline = float("inf")
        self.heartbeat_s = envs.SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL.get()
        self.max_heartbeat_failures = envs.SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE.get()
        self.next_heartbeat = now + self.heartbeat_s
        self.heartbeat_failures = 0

    def init(self, prefill_dp_rank: int) -> None:
        if self.initialised or self.state != KVPoll.Bootstrapping:  # e.g. aborted while pending
            return
        self.prefill_dp_rank, self.initialised = int(prefill_dp_rank), True
        self._bootstrap()

    registry_stalls = 0         # calls to the prefill's registry that stalled, in a row
    registry_quiet_until = 0.0  # monotonic: no call to it before then (one stalled)

    def _ask(self, call, *args: Any, signed: bool = True) -> Any:
        """`call(self.prefill_addr, *args)`, a registry call from SGLang's scheduler thread: at
        most REGISTRY_CALL_S; RegistryStalled at once while the registry is quiet after a stall
        (see REGISTRY_CALL_S). Only a `signed` call's answer (one the peer secret vouches for)
        ends a run of stalls: not a refused connection, nor /health, which anyone can answer."""
        if time.monotonic() < self.registry_quiet_until:
            raise bootstrap_registry.RegistryStalled(
                f"bootstrap registry {self.prefill_addr} stalled the last call; not asked again "
                f"for {self.registry_quiet_until - time.monotonic():.1f} s")
        try:
            result = call(self.prefill_addr, *args, timeout_s=REGISTRY_CALL_S)
        except bootstrap_registry.RegistryStalled:
            self.registry_stalls += 1
            self.registry_quiet_until = time.monotonic() + self.heartbeat_s
            raise
        if signed:
            self.registry_stalls = 0
        return result

    def _stalled_out(self) -> bool:
        """Fail the room once its registry stalled HEARTBEAT_MAX_FAILURE calls in a row."""
        if self.registry_stalls < self.max_heartbeat_failures:
            return False
        self._fail(ConnectionError(
            f"room {self.room}: the bootstrap registry at {self.prefill_addr} stalled "
            f"{self.registry_stalls} calls in a row (no answer within {REGISTRY_CALL_S:g} s, or "
            "more than a registry answers)"))
        return True

    @property
    def conclude_state(self) -> int | None:
        """SGLang's name for a room's final state (None while it goes on)."""
        return self.state if self.state in (KVPoll.Success, KVPoll.Failed) else None

    def abort(self) -> None:
        why = None if self.initialised else self.mgr.parallel_info_errors.get(self.prefill_addr)
        if why and self.state != KVPoll.Success:  # SGLang gave up learning the prefill's DP size
            return self._fail(ConnectionError(
                f"room {self.room}: aborted before the prefill's parallel info could be read "
                f"from {self.prefill_addr}: {why}"))
        super().abort()

    @property
    def prefill_rank_key(self) -> str:
        return bootstrap_registry.rank_key(self.prefill_dp_rank, self.mgr.kv_args.engine_rank)

    def _bootstrap(self) -> None:
        key = self.prefill_rank_key
        try:
            record = self._ask(bootstrap_registry.lookup, key)
        except bootstrap_registry.RegistryAuthError as exc:  # configuration: waiting cannot help
            return self._fail(PermissionError(f"room {self.room}: {exc}"))
        except (bootstrap_registry.RegistryUnreachable, RuntimeError, ValueError) as exc:
            if self._stalled_out():
                return None
            record, reason = None, str(exc)
        else:
            reason = f"prefill rank {key} has not registered at {self.prefill_addr}"
        if record is None and self.mgr.kv_args.engine_rank > 0:
            # a prefill of a smaller TP has no rank of this number: say so now, not at timeout
            record = self._first_rank_record()
            if record is not None and self._tp_mismatch(record) is None:
                record = None
        if record is not None and (mismatch := self._tp_mismatch(record)) is not None:
            return self._fail(mismatch)
        if record is None:
            if time.monotonic() > self.bootstrap_deadline:
                self._fail(TimeoutError(f"room {self.room}: bootstrap timed out: {reason}"))
            return
        if record.get("backend") != self.mgr.backend_name:
            return self._fail(RuntimeError(
                f"room {self.room}: the prefill at {self.prefill_addr} runs transfer backend "
                f"{record.get('backend')!r}, this decode {self.mgr.backend_name!r}"))
        if record.get("page_bytes") != self.mgr.buffers.page_bytes:
            return self._fail(RuntimeError(
                f"room {self.room}: the prefill's KV pages are {record.get('page_bytes')} bytes, "
                f"this decode's {self.mgr.buffers.page_bytes}: not the same model and KV layout"))
        try:
            self._accept(record)
        except ROOM_FAULTS as exc:
            return self._fail(exc)
        self.state = KVPoll.WaitingForInput

    def _first_rank_record(self) -> dict | None:
        key = bootstrap_registry.rank_key(self.prefill_dp_rank, 0)
        try:
            return self._ask(bootstrap_registry.lookup, key)
        except (bootstrap_registry.RegistryAuthError, bootstrap_registry.RegistryUnreachable,
                RuntimeError, ValueError):
            return None

    def _tp_mismatch(self, record: dict) -> Exception | None:
        theirs, ours = record.get("tp_size", 1), attention_tp_size(self.mgr.server_args)
        if theirs == ours:
            return None
        return NotImplementedError(
            f"room {self.room}: the prefill at {self.prefill_addr} runs attention TP {theirs}, "
            f"this decode TP {ours}: {self.mgr.backend_name} moves KV between equal TP sizes "
            "only (prefill rank k to decode rank k); run both sides at the same --tp-size, or "
            "use SGLang's own mooncake or nixl backend for different TP sizes")

    def send_metadata(self, kv_indices: np.ndarray, aux_index: Optional[int] = None,
                      state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None, destination: Any = None,
                      **_: Any) -> None:
        if self.state != KVPoll.WaitingForInput:
            return
        refused = _refuse_states(state_indices, self.mgr.backend_name)
        if refused:
            return self._fail(refused)
        if destination is not None and getattr(destination, "value", destination) != "device":
            return self._fail(NotImplementedError(f"{self.mgr.backend_name}: host destinations"))
        self.pages = np.asarray(kv_indices, dtype=np.int64)
        self.first_page = int(decode_prefix_len or 0) // self.mgr.kv_args.page_size
        self.aux_index = aux_index
        self.waiting_deadline = time.monotonic() + envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()
        self.started = time.perf_counter()
        self.state = KVPoll.Transferring

    def poll(self) -> int:
        if self.state == KVPoll.Bootstrapping and not self.initialised:
            # SGLang polls receivers still waiting for their prefill DP rank: no bootstrap
            # before init (the rank is unknown), only the timeout
            if time.monotonic() > self.bootstrap_deadline:
                why = self.mgr.parallel_info_errors.get(self.prefill_addr, "not resolved")
                self._fail(TimeoutError(f"room {self.room}: bootstrap timed out before the "
                                        f"prefill's DP rank was known: {why}"))
        elif self.state == KVPoll.Bootstrapping:
            self._bootstrap()
        elif self.state == KVPoll.Transferring:
            try:
                self._progress()
            except ROOM_FAULTS as exc:
                self._fail(exc)
        return self.state

    def _check_waiting(self) -> None:
        """While nothing has arrived: the waiting timeout, and the prefill's heartbeat."""
        now = time.monotonic()
        if now > self.waiting_deadline:
            return self._fail(TimeoutError(
                f"room {self.room}: no KV from the prefill at {self.prefill_addr} within "
                f"{envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()} s"))
        if self._stalled_out() or now < self.next_heartbeat:
            return
        self.next_heartbeat = now + self.heartbeat_s
        self._heartbeat()
        try:
            alive = self._ask(bootstrap_registry.health, signed=False)
        except bootstrap_registry.RegistryStalled:
            self._stalled_out()  # counted there (or quiet after a stall: not asked)
            return
        except bootstrap_registry.RegistryUnreachable:
            alive = False
        if alive:
            self.heartbeat_failures = 0
            return
        self.heartbeat_failures += 1
        if self.heartbeat_failures >= self.max_heartbeat_failures:
            # a prefill started again at this address may have another DP size: read it again
            self.mgr.prefill_info_table.pop(self.prefill_addr, None)
            self._fail(ConnectionError(
                f"room {self.room}: the prefill at {self.prefill_addr} is gone (its bootstrap "
                f"registry missed {self.heartbeat_failures} heartbeats)"))

    def _heartbeat(self) -> None:
        """A backend's own keep-alive to the prefill (pull backends extend its lease)."""

    def _accept(self, record: dict) -> None:
        raise NotImplementedError

    def _progress(self) -> None:
        raise NotImplementedError


class RegistryBootstrapServer(BaseKVBootstrapServer):
    """The prefill instance's bootstrap registry (transfer/bootstrap_registry.py)."""

    def __init__(self, host: str, port: int) -> None:
        # PD_BOOTSTRAP_HOST, else SGLang's --host; one other hosts can reach needs a configured
        # peer secret (transfer/bootstrap_registry.py, docs/security.md)
        self.registry = bootstrap_registry.BootstrapRegistry(
            bootstrap_registry.registry_host(host), port)

    def close(self) -> None:
        self.registry.close()
