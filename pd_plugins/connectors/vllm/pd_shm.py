"""PdShmConnector: KV moves through a shared-memory pool (a /dev/shm file or a CXL DAX device).

Selected with `--kv-transfer-config '{"kv_connector":"PdShmConnector","kv_role":...}'`; options in
`kv_connector_extra_config` (`ShmOptions`, transfer/options.py). Every engine on the host that
maps the same pool shares it:
- a prefill (kv_producer) writes the full blocks of each PD prefill leg into the pool while it
  computes them, skipping blocks the pool already has, and answers with the pool's id and the
  slots it used in `kv_transfer_params`;
- any engine looks each new request's block hashes up in the pool and copies the leading blocks it
  finds into its own paged KV cache before the forward pass; the engine computes only the rest.

Blocks are found by the engine's own block hash of the request's tokens (which covers the tokens,
LoRA, multimodal inputs and cache salt), never by an address from the request: a client cannot
make a decode read KV that does not belong to its own prompt. The slots in `kv_transfer_params`
are only hints, used when they hold exactly the expected block.

A block that vanished or changed while being copied (its lease ran out, or its checksum does not
match) is a failed load, handled by vLLM's `kv_load_failure_policy` (recompute or fail). The
pool's own rules (leases, publish order, eviction) are in pd_plugins/transfer/shm_pool.py.

Verification (`verify_kv`, on by default; issue 28): the pool's per-slot checksum, which its
writer takes in the same pass as its copy, is the producer's statement; the reader sums what
landed in its KV cache in the same pass as its copy and compares. A slot that fails is never
used, and is dropped from the pool (`ShmKVPool.discard`) so no later request loads it again.
Each loading request's verdict goes into its answer (`pd.kv`) and onto /metrics
(kv_verdicts.py). Fault injection (`faults`, transfer/kv_faults.py): `flip_slot` damages a byte
of a slot the prefill just published, which the decode must then catch; `reuse` gives a slot
the decode pinned a new generation before its copy, which its generation check must catch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from pd_plugins.connectors.vllm.expert_signatures import ExpertSignatures
from pd_plugins.connectors.vllm.kv_layout import kv_layout, require_heads_outermost
from pd_plugins.connectors.vllm.kv_verdicts import FAULTS_INJECTED_KEY, LoadOutcome, VerdictBook
from pd_plugins.connectors.vllm.options import extra_options
from pd_plugins.connectors.vllm.pd_shm_stats import PdShmPromMetrics, PdShmStats
from pd_plugins.connectors.vllm.pool_connector import PoolWorkerSide, SyncPoolConnector
from pd_plugins.connectors.vllm.pool_scheduler import PoolSchedulerSide, Storing
from pd_plugins.transfer.kv_faults import KvFaults, position
from pd_plugins.transfer.options import KvFaultOptions, ShmOptions
from pd_plugins.transfer.paged_kv import PagedKV
from pd_plugins.transfer.shm_pool import PoolError, ShmKVPool, SlotRef, SlotRefs
from pd_plugins.vocab.block_keys import block_keys, prompt_root

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

POOL_ID_KEY = "pool_id"
POOL_SLOTS_KEY = "pool_slots"


def pool_key(block_hash: bytes, rank: int) -> bytes:
    """The pool key of one block: the engine's block hash, per tensor-parallel rank (with
    `head_groups`: per head group, rank r of a TP t engine holding groups r*G/t .. (r+1)*G/t-1)."""
    return hashlib.blake2b(bytes(block_hash), digest_size=32,
                           person=b"pd-shm-r%d" % rank).digest()


def default_pool_path(vllm_config: VllmConfig, layout: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(
        str(vllm_config.model_config.model).rstrip("/")))[:40]
    return f"/dev/shm/pd-kv-{name}-{hashlib.sha1(layout.encode()).hexdigest()[:10]}"


# -- what the scheduler tells the workers each step -----------------------------------------------
@dataclass
class LoadOp:
    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    hints: list[SlotRef | None]


@dataclass
class StoreOp:
    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    content_keys: list[int]


@dataclass
class PdShmMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)

    @property
    def has_loads(self) -> bool:
        return bool(self.loads)


def _slot_hints(params: Any, pool_id: str, first: int, count: int) -> list[SlotRef | None]:
    """Slot hints from a prefill's kv_transfer_params (for this pool only; anything malformed
    is ignored, as the hints are verified against the expected block anyway)."""
    hints: list[SlotRef | None] = [None] * count
    if not isinstance(params, dict) or params.get(POOL_ID_KEY) != pool_id:
        return hints
    slots = params.get(POOL_SLOTS_KEY)
    if not isinstance(slots, list):
        return hints
    for i in range(count):
        item = slots[first + i] if first + i < len(slots) else None
        if (isinstance(item, list) and len(item) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in item)
                and 0 <= item[0] < 1 << 63 and 0 <= item[1] < 1 << 64):  # the pool's int64/uint64
            hints[i] = SlotRef(item[0], item[1])
    return hints


# -- scheduler side ---------------------------------------------------------------------------------
@dataclass
class _ShmStoring(Storing):
    content_keys: list[int] | None = None  # the prompt's block keys, computed once


class _SchedulerSide(PoolSchedulerSide[int]):
    """Finds a prompt's blocks in the pool by their block hashes; a hit is its first block not
    computed locally. Stores each step's newly completed blocks."""

    MODE = "shm"

    def find(self, request: Request, num_computed_tokens: int) -> tuple[int, int]:
        bs = self.c.block_size
        first = num_computed_tokens // bs
        hashes = request.block_hashes[first:]
        found = self.c.pool.count_prefix([pool_key(h, 0) for h in hashes]) if hashes else 0
        return (first + found) * bs, first

    def prefill_stored(self, params: dict[str, Any]) -> int | None:
        slots = params.get(POOL_SLOTS_KEY)
        return len(slots) * self.c.block_size if isinstance(slots, list) else None

    def load_op(self, request: Request, blocks: KVCacheBlocks, hit: int,
                num_external_tokens: int) -> LoadOp:
        first, count = hit, -(-num_external_tokens // self.c.block_size)
        block_ids = blocks.get_block_ids()[0][first:first + count]
        return LoadOp(request.request_id, list(block_ids),
                      list(request.block_hashes[first:first + count]),
                      _slot_hints(request.kv_transfer_params, self.c.pool.pool_id, first, count))

    def begin_store(self, request: Request) -> _ShmStoring:
        return _ShmStoring(request)

    def store_op(self, storing: _ShmStoring, done: int) -> StoreOp | None:
        req, bs = storing.request, self.c.block_size
        full = min(done // bs, len(req.block_hashes))
        if full <= storing.next_block:
            return None
        if storing.content_keys is None:
            # the router's keys, per LoRA adapter and cache_salt as the router keys a request's
            lora = req.lora_request.lora_name if req.lora_request is not None else None
            root = prompt_root(lora, getattr(req, "cache_salt", None))
            storing.content_keys = block_keys(req.prompt_token_ids or [], bs, root)
        block_ids = self.c.kv_cache_manager.get_block_ids(req.request_id)[0]
        op = StoreOp(req.request_id, list(block_ids[storing.next_block:full]),
                     list(req.block_hashes[storing.next_block:full]),
                     storing.content_keys[storing.next_block:full])
        storing.next_block = full
        return op

    def metadata(self, loads: list[LoadOp], stores: list[StoreOp]) -> PdShmMetadata:
        return PdShmMetadata(loads=loads, stores=stores)

    def answer(self, request: Request) -> dict[str, Any]:
        full = request.num_prompt_tokens // self.c.block_size
        refs = self.c.pool.lookup([pool_key(h, 0) for h in request.block_hashes[:full]])
        return {POOL_ID_KEY: self.c.pool.pool_id,
                POOL_SLOTS_KEY: [[r.slot, r.seq] if r else None for r in refs]}

    def experts(self, request: Request) -> dict | None:
        return self.c.experts.take(request.request_id)

    def verdict_book(self) -> VerdictBook | None:
        if self.c.options.verify_kv == "off":
            return None
        return VerdictBook("shm", recompute=self.c.failure_policy == "recompute")

    def load_checked(self, op: LoadOp) -> bool:
        return self.c.pool.checksums


# -- worker side ------------------------------------------------------------------------------------
@dataclass
class _PendingStore:
    op: StoreOp
    ids: list[int]            # the op's blocks as PagedKV's (head group) blocks, one per slot
    positions: list[int]      # which of `ids` got a slot
    refs: SlotRefs
    checksums: Any            # np.ndarray[uint64], summed over layers
    layers_done: set[int] = field(default_factory=set)
    # the slots' fence (ShmKVPool.writing), from the first layer's copy until published: no
    # slot can change hands meanwhile, so one fence a step (not one per layer) covers the copies
    fence: contextlib.ExitStack | None = None
    owned: Any = None         # np.ndarray[bool]: slots still this writer's when fenced


class _WorkerSide(PoolWorkerSide):
    STATS = PdShmStats

    def __init__(self, connector: PdShmConnector) -> None:
        super().__init__()
        self.c = connector
        self.kv: PagedKV | None = None
        self._layer_index: dict[str, int] = {}
        self._pending: list[_PendingStore] = []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        c = self.c
        group = c.kv_cache_config.kv_cache_groups[0]
        tensors = [kv_caches[n] for n in group.layer_names]
        if c.pieces > 1:  # head groups: each block's heads must be its outer dimension
            require_heads_outermost(tensors, c.kv_cache_config.num_blocks, group.kv_cache_spec,
                                    "PdShmConnector")
        self.kv = PagedKV(tensors, c.kv_cache_config.num_blocks, pieces=c.pieces)
        if self.kv.block_bytes != c.slot_bytes:
            raise ValueError(f"PdShmConnector: KV tensors hold {self.kv.block_bytes} bytes per "
                             f"block, the KV spec says {c.slot_bytes}")
        self._layer_index = {n: i for i, n in enumerate(group.layer_names)}

    def _keys(self, block_hashes: list) -> list[bytes]:
        """The pool keys of this rank's slots of each block, block by block."""
        k = self.c.pieces
        return [pool_key(h, self.c.rank * k + j) for h in block_hashes for j in range(k)]

    def _ids(self, block_ids: list[int]) -> list[int]:
        """PagedKV's blocks (one per slot) of the engine's `block_ids`, as `_keys` orders them."""
        k = self.c.pieces
        return [b * k + j for b in block_ids for j in range(k)]

    # saving
    def begin_step(self, meta: PdShmMetadata) -> None:
        if self.c.options.save_mode == "layer":
            self._reserve(meta.stores)

    def _reserve(self, stores: list[StoreOp]) -> None:
        k = self.c.pieces
        for op in stores:
            keys = self._keys(op.block_hashes)
            content = [key for key in op.content_keys for _ in range(k)]
            refs = self.c.pool.reserve(keys, content, write_lease_s=self.c.options.read_lease_s)
            positions = [i for i, r in enumerate(refs) if r is not None]
            if len(positions) < len(refs):
                # in the pool, or being written by another writer (it publishes them); the
                # rest found no slot (the pool is full of held, pinned or leased ones)
                present = self.c.pool.lookup([keys[i] for i, r in enumerate(refs) if r is None],
                                             writing=True)
                n_present = sum(r is not None for r in present)
                self.stats.count("present_blocks", n_present)
                self.stats.count("unstored_blocks", len(present) - n_present)
                if self.c.options.hold_s and n_present:
                    # its decode loads these too: the hold a publish gives (one being written
                    # gets its writer's at publish)
                    self.c.pool.extend_hold(present, self.c.options.hold_s)
            if positions:
                self._pending.append(_PendingStore(
                    op, self._ids(op.block_ids), positions, refs.present(),
                    np.zeros(len(positions), dtype=np.uint64)))

    def _write_layer(self, p: _PendingStore, layer: int) -> None:
        pool = self.c.pool
        if p.fence is None:
            # a slot whose reservation lapsed and was taken over is not written (its publish
            # fails): a stalled step never changes another writer's block
            p.fence = contextlib.ExitStack()
            p.owned = p.fence.enter_context(pool.writing(p.refs))
        keep = np.flatnonzero(p.owned)
        if keep.size == len(p.positions):
            p.checksums += self.kv.save_layer(  # sums wrap mod 2**64, as the pool's do
                layer, [p.ids[i] for i in p.positions], pool.data, p.refs.slots,
                checksums=pool.checksums)
        elif keep.size:
            p.checksums[keep] += self.kv.save_layer(
                layer, [p.ids[p.positions[i]] for i in keep.tolist()], pool.data,
                p.refs.slots[keep], checksums=pool.checksums)
        p.layers_done.add(layer)

    def save_kv_layer(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._pending:
            return
        start = time.perf_counter()
        for p in self._pending:
            self._write_layer(p, layer)
        self.stats.count("store_seconds", time.perf_counter() - start)

    def wait_for_save(self, meta: PdShmMetadata) -> None:
        start = time.perf_counter()
        if self.c.options.save_mode == "step":
            self._reserve(meta.stores)
        self._drop_unowned_stores()
        self.end_step()
        if not self._pending:
            return
        pool, kv = self.c.pool, self.kv
        publishes = []
        for p in self._pending:
            for layer in range(len(kv.layers)):  # layers save_kv_layer was not called for
                if layer not in p.layers_done:
                    self._write_layer(p, layer)
            publishes += [(ref, int(chk), kv.block_bytes) for ref, chk in zip(p.refs, p.checksums)]
        pending, self._pending = self._pending, []
        try:
            ok = pool.publish(publishes, hold_s=self.c.options.hold_s)
        finally:
            for p in pending:
                if p.fence is not None:
                    p.fence.close()
        if self.c.faults.enabled:
            self._flip_slots(pending, ok)
        stored = sum(ok)
        self.stats.count("stored_blocks", stored)
        self.stats.count("unstored_blocks", len(ok) - stored)
        self.stats.count("stored_bytes", stored * kv.block_bytes)
        self.stats.count("store_seconds", time.perf_counter() - start)

    def _drop_unowned_stores(self) -> None:
        """A store's blocks from its request's first failed load of this step on are not
        published (own_blocks): their reservations are given back, and the scheduler stores
        them once vLLM has recomputed them."""
        kept = []
        for p in self._pending:
            first_bad = self.own_blocks(p.op.req_id, p.op.block_ids) * self.c.pieces
            keep = [i for i, position in enumerate(p.positions) if position < first_bad]
            if len(keep) < len(p.positions):
                dropped = [p.refs[i] for i in range(len(keep), len(p.positions))]
                self.c.pool.abandon(dropped)
                self.stats.count("unstored_blocks", len(dropped))
                logger.warning("PdShmConnector: request %s: %d blocks not stored (a load of this "
                               "prompt failed: they are not its KV)", p.op.req_id, len(dropped))
                if not keep:
                    if p.fence is not None:
                        p.fence.close()
                    continue
                p.positions = [p.positions[i] for i in keep]
                p.refs = SlotRefs(p.refs.slots[keep], p.refs.seqs[keep])
                p.checksums = p.checksums[keep]
                if p.owned is not None:
                    p.owned = p.owned[keep]
            kept.append(p)
        self._pending = kept

    def _flip_slots(self, pending: list[_PendingStore], ok: list[bool]) -> None:
        """Fault injection (`flip_slot`): one byte of one slot each targeted store published,
        its header (and checksum) untouched, as a stray write or a bad memory line would."""
        at = 0
        for p in pending:
            published = [ref.slot for ref, done in zip(p.refs, ok[at:at + len(p.refs)]) if done]
            at += len(p.refs)
            rule = self.c.faults.take("flip_slot", p.op.req_id) if published else None
            if rule is None:
                continue
            slot = published[position(rule, p.op.req_id, len(published))]
            byte = position(rule, p.op.req_id + "/byte", self.kv.block_bytes)
            self.c.pool.data[slot, byte] ^= np.uint8(0xFF)
            self.stats.count(FAULTS_INJECTED_KEY)

    # loading
    def start_load_kv(self, meta: PdShmMetadata) -> None:
        if not meta.loads:
            return
        start = time.perf_counter()
        for op in meta.loads:
            self._load(op)
        self.stats.count("load_seconds", time.perf_counter() - start)

    def _load(self, op: LoadOp) -> None:
        pool, kv, k = self.c.pool, self.kv, self.c.pieces
        ids = self._ids(op.block_ids)
        hints = [hint if j == 0 else None for hint in op.hints for j in range(k)]  # group 0's
        pinned = pool.pin(self._keys(op.block_hashes), hints,
                          read_lease_s=self.c.options.read_lease_s)
        have = [i for i, p in enumerate(pinned) if p is not None]
        good: set[int] = set()
        checked = pool.checksums
        torn, mismatched = 0, []
        if have:
            keep = [pinned[i] for i in have]
            if self.c.faults.enabled:
                self._reuse_slot(op.req_id, keep)
            # straight into the KV cache; a block is only used if it checks out afterwards
            sums = kv.load(pool.data, [p.slot for p in keep], [ids[i] for i in have],
                           checksums=checked)
            kept = pool.unpin(keep)  # False: the slot was reused while copied (a torn copy)
            for i, same, got, p in zip(have, kept, sums, keep):
                if not same:
                    torn += 1
                elif checked and int(got) != p.checksum:
                    mismatched.append(p)  # the bytes are not what their writer summed
                else:
                    good.add(i)
            if mismatched:
                self.stats.count("discarded_blocks", pool.discard(mismatched))
        # a block is loaded when every one of its slots is (all its head groups)
        failed = [b for n, b in enumerate(op.block_ids)
                  if any(n * k + j not in good for j in range(k))]
        if failed:
            self.fail_blocks(op.req_id, failed)
            logger.warning("PdShmConnector: request %s: %d of %d pool blocks failed to load "
                           "(%d slots gone, %d replaced while copied, %d checksum mismatches)",
                           op.req_id, len(failed), len(op.block_ids),
                           len(ids) - len(have), torn, len(mismatched))
        good_blocks = len(op.block_ids) - len(failed)
        self.stats.count("loaded_blocks", good_blocks)
        self.stats.count("failed_blocks", len(failed))
        self.stats.count("loaded_bytes", good_blocks * k * kv.block_bytes)
        if self.c.options.verify_kv != "off":
            self.record_load(op.req_id, LoadOutcome(len(op.block_ids), len(failed),
                                                    len(mismatched), checked))

    def _reuse_slot(self, req_id: str, pinned: list) -> None:
        """Fault injection (`reuse`): one pinned slot gets a new generation between pin and copy,
        as a reuse would; `unpin` must report the copy torn."""
        rule = self.c.faults.take("reuse", req_id)
        if rule is not None:
            self.c.pool.reuse_pinned(pinned[position(rule, req_id, len(pinned))])
            self.stats.count(FAULTS_INJECTED_KEY)


class PdShmConnector(SyncPoolConnector):
    STATS = PdShmStats
    OPTIONS = ShmOptions
    PROM_METRICS = PdShmPromMetrics

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        self.rank = vllm_config.parallel_config.rank
        # head groups: this engine's rank holds `pieces` of the pool's head groups per block
        groups = self.options.head_groups or vllm_config.parallel_config.tensor_parallel_size
        kv = kv_layout(vllm_config, kv_cache_config, "pd-shm v1", "PdShmConnector",
                       head_groups=self.options.head_groups)
        self.pieces = groups // vllm_config.parallel_config.tensor_parallel_size
        layout, self.slot_bytes = kv.description, kv.block_bytes
        path = self.options.pool_path or default_pool_path(vllm_config, layout)
        self.faults = KvFaults.from_spec(
            extra_options(KvFaultOptions, vllm_config.kv_transfer_config,
                          "PdShmConnector").faults, "PdShmConnector")
        verify = self.options.verify_kv
        checksums = self.options.checksums
        if checksums is None and verify != "off":
            checksums = True  # verification needs the writers' sums
        self.pool = ShmKVPool(path, slot_bytes=self.slot_bytes, layout=layout,
                              size_bytes=self.options.pool_size_bytes,
                              checksums=checksums, group=self.options.pool_group,
                              remove_when_unused=self.options.remove_when_unused)
        if checksums is not None and self.pool.checksums != checksums:
            logger.warning("PdShmConnector: pool %s was created with checksums %s; following "
                           "it (every engine of a pool must agree)", path,
                           "on" if self.pool.checksums else "off")
        if verify != "off" and not self.pool.checksums:
            why = (f"PdShmConnector: pool {path} has no checksums, so its blocks cannot be "
                   f"verified (`pd-pool remove {path}` while no engine uses it, then restart: "
                   f"a new pool gets them)")
            if verify == "required":
                self.pool.close()
                raise PoolError(why + "; verify_kv is `required`")
            logger.warning("%s; loads are reported `unverified`", why)
        logger.info("PdShmConnector (%s, %s): pool %s, %d slots of %d bytes",
                    vllm_config.kv_transfer_config.kv_role,
                    role.name, path, self.pool.num_slots, self.pool.slot_bytes)
        self.experts = ExpertSignatures(vllm_config, role)
        self._scheduler = _SchedulerSide(self) if role == KVConnectorRole.SCHEDULER else None
        self._worker = _WorkerSide(self) if role == KVConnectorRole.WORKER else None

    # -- worker side -------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.begin_step(connector_metadata)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        if self.options.save_mode == "layer":
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata())
        self.experts.after_step()

    def shutdown(self) -> None:
        self.experts.close()
        self.pool.close()
