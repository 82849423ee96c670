"""PdLMCacheConnector: KV moves through an LMCache pool (CPU, disk, fs://, lm://, redis://, mp://).

Selected with `--kv-transfer-config '{"kv_connector":"PdLMCacheConnector","kv_role":...,
"kv_connector_extra_config":{"backend":"redis://127.0.0.1:6379"}}'`; options in `LMCacheOptions`
(transfer/options.py).
- a prefill (kv_producer) stores the full chunks of each PD prefill leg's prompt into LMCache
  after computing them and answers with how many tokens it stored;
- any engine looks each new request's prompt up in LMCache and retrieves the leading chunks it
  finds into its own paged KV cache before the forward pass; the engine computes only the rest.

LMCache finds chunks by a hash of the request's own tokens (and our layout fingerprint), never by
an address from the request: a client cannot make a decode read another prompt's KV. Everything
else vLLM's block hashes include (LoRA adapter, multimodal inputs, `cache_salt`) goes into the
chunk keys as the request's namespace (`pool_namespace`), so requests that differ in those never
share chunks; requests with prompt embeddings bypass the pool (counted). Chunks the pool lost
(evicted, server down) are failed loads, handled by vLLM's `kv_load_failure_policy`.

Only backends that engines share can carry PD KV from a prefill to a decode: `fs://` (a directory
on the host), `lm://`, `redis://` and `mp://` (an LMCache server). `cpu` and `disk://` are each
engine's own: they serve prefix reuse within one engine (`store: all`), not PD. `backend` has no
default: an engine without one refuses to start and says which to pick, rather than run on a pool
of its own that would move no KV.
The LMCache side (its engine, our CPU copy of paged KV) is in pd_plugins/transfer/lmcache_pool.py
and, for `mp://`, pd_plugins/transfer/lmcache_mp.py. The LMCache engine lives in the worker
process; the scheduler asks it over transfer/lookup_channel.py (an LMCache server, mp://, is
asked directly).

Verification (`verify_kv`, on by default; issue 28, docs/plans/kv-verification.md §4.4): after
its store, a prefill digests the blocks of the prompt's full chunks in its own KV cache (stored
now or found present: its bytes for those came from the pool itself, `lookup`), sends them to
its scheduler over the signature channel (purpose "kv-digests", as PdNixlConnector's pull does)
and states them in its answer (`pd.kv_digest`). The decode ships them with the retrieval and,
right after it, digests the blocks it retrieved (block_verifier.py, the same ws64 over the
decode's own paged blocks, so mp:// is checked the same way): a mismatch at block k (a stale
chunk under this prompt's key, damaged bytes) makes blocks k.. failed loads, recomputed or failed
per kv_load_failure_policy. Each loading request's verdict goes into its answer (`pd.kv`) and
onto /metrics (kv_verdicts.py); a load with no digests (a plain prefix hit, an older prefill,
TP > 1 on either side) is `unverified`.

Between TP sizes (`head_groups`, transfer/lmcache_head_groups.py): each chunk's KV heads are
stored as that many chunks of their own, so a TP 2 prefill and a TP 1 decode (or the other way
round) share the pool; a TP engine's scheduler asks every rank's worker (`RanksLookup`). Faults (`faults`, transfer/kv_faults.py): `stale_chunk` (prefill: one
chunk of a targeted prompt is stored from other blocks) and `corrupt` (decode: one byte of one
retrieved block, before the check).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from pd_plugins.connectors.transfer_params import asks_remote_decode
from pd_plugins.connectors.vllm.block_verifier import BlockVerifier, first_mismatch
from pd_plugins.connectors.vllm.counter_stats import CounterPromMetrics, CounterStats
from pd_plugins.connectors.vllm.kv_layout import kv_layout, require_heads_outermost
from pd_plugins.connectors.vllm.kv_verdicts import (
    FAULTS_INJECTED_KEY,
    KV_VERIFY_COUNTERS,
    LoadOutcome,
    VerdictBook,
)
from pd_plugins.connectors.vllm.options import extra_options
from pd_plugins.connectors.vllm.pd_nixl_verify import DigestChannel, expected_digests
from pd_plugins.connectors.vllm.pool_connector import PoolWorkerSide, SyncPoolConnector
from pd_plugins.connectors.vllm.pool_scheduler import PoolSchedulerSide, Storing
from pd_plugins.transfer.lmcache_client import LMCacheClient
from pd_plugins.transfer.lmcache_head_groups import HeadGroupPools, groups_of_rank
from pd_plugins.transfer import kv_digest
from pd_plugins.transfer.kv_faults import KvFaults, position
from pd_plugins.transfer.lookup_channel import LookupServer, RanksLookup, lookup_address
from pd_plugins.transfer.options import SHARED_LMCACHE_BACKENDS, KvFaultOptions, LMCacheOptions
from pd_plugins.vocab.transfer_params import STORED_TOKENS_KEY, KvDigest, stored_tokens_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

LMCACHE_COUNTERS = {
    "stored_tokens": ("vllm:pd_lmcache_stored_tokens", "Prompt tokens whose KV was stored."),
    "retrieved_tokens": ("vllm:pd_lmcache_retrieved_tokens",
                         "Prompt tokens whose KV was retrieved from the pool."),
    "failed_tokens": ("vllm:pd_lmcache_failed_tokens",
                      "Tokens the scheduler found in the pool but the retrieval did not bring "
                      "(evicted, backend down): recomputed or failed per kv_load_failure_policy."),
    "unstored_tokens": ("vllm:pd_lmcache_unstored_tokens",
                        "Prompt tokens not stored in the step a load of their prompt failed "
                        "(not the prompt's KV; stored once recomputed)."),
    "store_seconds": ("vllm:pd_lmcache_store_seconds", "Time spent storing into the pool."),
    "retrieve_seconds": ("vllm:pd_lmcache_retrieve_seconds",
                         "Time spent retrieving from the pool."),
    "unpooled_requests": ("vllm:pd_lmcache_unpooled_requests",
                          "Requests the pool cannot key (prompt embeddings): neither looked up "
                          "nor stored."),
    "missing_digests": ("vllm:pd_lmcache_missing_digests",
                        "Prefill legs answered without KV digests (none came from the worker in "
                        "time): their decodes load unverified."),
    "unverifiable_hits": ("vllm:pd_lmcache_unverifiable_hits",
                          "Pool hits not used because verify_kv is `required` and no digests "
                          "state their bytes (computed instead)."),
    **KV_VERIFY_COUNTERS,
}


class PdLMCacheStats(CounterStats):
    COUNTERS = LMCACHE_COUNTERS


class PdLMCachePromMetrics(CounterPromMetrics):
    COUNTERS = LMCACHE_COUNTERS


def open_pool(options: LMCacheOptions, layout: str, num_layers: int, block_size: int,
              page_elements: int, dtype: torch.dtype, rank: int, world_size: int,
              instance_id: str) -> LMCacheClient:
    """The LMCache side for `options.backend`: an LMCache server over ZMQ (mp://) or an
    LMCache engine in this process (every other backend)."""
    chunk = options.chunk_size or block_size
    if chunk % block_size:
        raise ValueError(f"PdLMCacheConnector: chunk_size {chunk} is not a multiple of the "
                         f"block size {block_size}")
    common = dict(layout=layout, num_layers=num_layers, block_size=block_size, chunk_size=chunk,
                  kv_dtype=dtype, layer_block_shape=(page_elements,), rank=rank,
                  world_size=world_size, timeout_s=options.timeout_s, instance_id=instance_id)
    if options.backend.startswith("mp://"):
        from pd_plugins.transfer.lmcache_mp import LMCacheMPClient

        return LMCacheMPClient(options.backend, **common)
    from pd_plugins.transfer.lmcache_pool import LMCachePool

    return LMCachePool(options.backend, local_cpu_gb=options.local_cpu_gb, **common)


def pool_namespace(request: Request) -> str | None:
    """What besides the token ids decides this request's KV, as a key namespace: "" for a
    plain request, None when the pool cannot key it (prompt embeddings: the token ids are
    placeholders). The same inputs as vLLM's block hashes (kv_cache_utils.py,
    generate_block_hash_extra_keys): the LoRA adapter's name and path, each multimodal input's
    identifier and position, the cache salt. Request-wide, so two requests share chunks only if
    all of these agree (a request with an image shares no chunk with one without it)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    parts: list[tuple] = []
    lora = request.lora_request
    if lora:
        parts.append(("lora", lora.lora_name, lora.lora_path))
    for feature in request.mm_features or ():
        position = feature.mm_position
        parts.append(("mm", feature.identifier, position.offset, position.length))
    if request.cache_salt:
        parts.append(("cache_salt", request.cache_salt))
    if not parts:
        return ""
    return hashlib.blake2b(msgspec.msgpack.encode(parts), digest_size=16).hexdigest()


# The scheduler's lookups travel to the worker's LMCache engine as a list of token ids
# (transfer/lookup_channel.py); a namespace rides in front as [-1, four 32-bit words]: token ids
# are never negative, so the two forms cannot be confused.
_NAMESPACE_MARK = -1


def lookup_message(tokens: list[int], namespace: str) -> list[int]:
    if not namespace:
        return tokens
    raw = bytes.fromhex(namespace)
    return [_NAMESPACE_MARK, *(int.from_bytes(raw[i:i + 4], "big") for i in range(0, 16, 4)),
            *tokens]


def split_lookup_message(message: list[int]) -> tuple[list[int], str]:
    if not message or message[0] != _NAMESPACE_MARK:
        return message, ""
    words = message[1:5]
    if len(words) != 4 or not all(0 <= w < 1 << 32 for w in words):
        raise ValueError("malformed namespace in a lookup")
    return message[5:], b"".join(w.to_bytes(4, "big") for w in words).hex()


# -- what the scheduler tells the worker each step --------------------------------------------------
@dataclass
class RetrieveOp:
    req_id: str
    tokens: list[int]      # whole chunks, all present in the pool at lookup time
    block_ids: list[int]   # the request's blocks covering `tokens`
    skip_tokens: int       # already in the engine's own prefix cache: not overwritten
    needed_tokens: int     # what the scheduler counted on (skip_tokens + external tokens)
    namespace: str = ""    # pool_namespace
    # the prefill's digests of blocks skip_tokens // block_size .. len(block_ids) (None: the load
    # is not checked, `why`)
    expected: list[int] | None = None
    why: str | None = None


@dataclass
class StoreOp:
    req_id: str
    tokens: list[int]      # the prompt's full chunks
    block_ids: list[int]
    namespace: str = ""    # pool_namespace
    digest: bool = False   # a PD prefill leg: its blocks' digests go to the scheduler


@dataclass
class PdLMCacheMetadata(KVConnectorMetadata):
    retrieves: list[RetrieveOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)

    @property
    def has_loads(self) -> bool:
        return bool(self.retrieves)


def loaded_blocks(op: RetrieveOp, block_size: int) -> tuple[int, int]:
    """The first block a retrieval loads for vLLM (below it: the engine's own prefix cache) and
    how many it loads: up to the block holding the last token the scheduler counted on."""
    first = op.skip_tokens // block_size
    return first, max(0, -(-op.needed_tokens // block_size) - first)


# -- scheduler side ---------------------------------------------------------------------------------
class _SchedulerSide(PoolSchedulerSide[tuple[int, int]]):
    """Asks the pool for a prompt's leading chunks by its tokens and namespace; a hit is
    (tokens computed locally, tokens in the pool). Stores a prompt's full chunks once the whole
    prompt is computed."""

    MODE = "lmcache"

    def __init__(self, connector: PdLMCacheConnector) -> None:
        super().__init__(connector)
        self._stored: dict[str, int] = {}  # req id -> prompt tokens sent to the pool
        self._namespaces: dict[str, str | None] = {}  # req id -> pool_namespace
        # req id -> the prefill's digests of the prompt's blocks, or None and why not
        self._expected: dict[str, tuple[np.ndarray | None, str | None]] = {}
        self._digested: set[str] = set()  # prefill legs whose worker sends their digests

    def _namespace(self, request: Request) -> str | None:
        req_id = request.request_id
        if req_id not in self._namespaces:
            namespace = self._namespaces[req_id] = pool_namespace(request)
            if namespace is None:
                self.c.count_on_scheduler("unpooled_requests")
                logger.debug("PdLMCacheConnector: request %s has prompt embeddings, which the "
                             "pool cannot key: not looked up, not stored", req_id)
        return self._namespaces[req_id]

    def poolable(self, request: Request) -> bool:
        return self._namespace(request) is not None

    def find(self, request: Request, num_computed_tokens: int) -> tuple[int, tuple[int, int]]:
        prompt = request.prompt_token_ids or []
        hit = (self.c.lookup(prompt, self._namespace(request))
               if len(prompt) >= self.c.chunk_size else 0)
        if hit and self.c.options.verify_kv == "required":
            digests, why = self._digests(request, hit)
            if digests is None:
                self.c.count_on_scheduler("unverifiable_hits")
                logger.warning("PdLMCacheConnector: request %s: %d prompt tokens in the pool "
                               "not used (%s; verify_kv is `required`)", request.request_id,
                               hit, why)
                hit = 0
        return hit, (num_computed_tokens, hit)

    def _digests(self, request: Request, present: int) -> tuple[np.ndarray | None, str | None]:
        """The prefill's digests of the request's blocks (at least those of the `present`
        tokens the pool holds), or None and why there are none."""
        req_id, bs = request.request_id, self.c.block_size
        if req_id not in self._expected:
            encoded, why = expected_digests(request.kv_transfer_params, bs)
            stated = None
            if encoded is not None:
                try:  # a client's value: bounded by the prompt
                    stated = kv_digest.decode(encoded, -(-request.num_prompt_tokens // bs))
                except ValueError as exc:
                    why = f"unusable digests: {exc}"
            self._expected[req_id] = (stated, why)
        stated, why = self._expected[req_id]
        if stated is not None and len(stated) < present // bs:
            return None, f"{len(stated)} digests for {present // bs} blocks in the pool"
        return stated, why

    def prefill_stored(self, params: dict[str, Any]) -> int | None:
        return stored_tokens_of(params)

    def load_op(self, request: Request, blocks: KVCacheBlocks, hit: tuple[int, int],
                num_external_tokens: int) -> RetrieveOp:
        c = self.c
        computed, present = hit
        needed = computed + num_external_tokens
        end = min(present, -(-needed // c.chunk_size) * c.chunk_size)
        block_ids = blocks.get_block_ids()[0][:-(-end // c.block_size)]
        expected, why = None, "verify_kv is off"
        if self.verdicts is not None and c.world_size > 1:
            why = "this engine has several ranks: the prefill's digests cover whole blocks"
        elif self.verdicts is not None:
            stated, why = self._digests(request, end)
            if stated is not None:
                expected = [int(d) for d in stated[computed // c.block_size:len(block_ids)]]
        return RetrieveOp(request.request_id, list(request.prompt_token_ids[:end]),
                          list(block_ids), skip_tokens=computed, needed_tokens=needed,
                          namespace=self._namespaces.get(request.request_id) or "",
                          expected=expected, why=why)

    def verdict_book(self) -> VerdictBook | None:
        if self.c.options.verify_kv == "off":
            return None
        return VerdictBook("lmcache", recompute=self.c.failure_policy == "recompute")

    def load_checked(self, op: RetrieveOp) -> bool:
        return op.expected is not None

    def load_blocks(self, op: RetrieveOp) -> int:
        return loaded_blocks(op, self.c.block_size)[1]

    def store_op(self, storing: Storing, done: int) -> StoreOp | None:
        c, req = self.c, storing.request
        full = req.num_prompt_tokens // c.chunk_size * c.chunk_size
        if done < req.num_prompt_tokens or not full:
            return None
        block_ids = c.kv_cache_manager.get_block_ids(req.request_id)[0]
        self._stored[req.request_id] = full
        digest = c.digests is not None and asks_remote_decode(req.kv_transfer_params)
        if digest:
            self._digested.add(req.request_id)
        return StoreOp(req.request_id, list(req.prompt_token_ids[:full]),
                       list(block_ids[:full // c.block_size]),
                       self._namespaces.get(req.request_id) or "", digest=digest)

    def metadata(self, loads: list[RetrieveOp], stores: list[StoreOp]) -> PdLMCacheMetadata:
        return PdLMCacheMetadata(retrieves=loads, stores=stores)

    def answer(self, request: Request) -> dict[str, Any]:
        return {STORED_TOKENS_KEY: self._stored.get(request.request_id, 0)}

    def kv_digest(self, request: Request) -> KvDigest | None:
        if request.request_id not in self._digested:
            return None  # nothing stored (a prompt shorter than a chunk), or verify_kv off
        # a prefill that failed (a load, under kv_load_failure_policy fail) finishes in the step
        # its store was cut in: its digests never come
        asked = request.status != RequestStatus.FINISHED_ERROR
        digests, why = self.c.digests.take(request.request_id, self.c.block_size, asked)
        if digests is None:
            self.c.count_on_scheduler("missing_digests")
            if why == "late":  # (a worker that cannot digest said so once, at start)
                logger.warning("PdLMCacheConnector: no KV digests for prefill %s in time; its "
                               "decode loads it unverified", request.request_id)
        return digests

    def forget(self, request_id: str) -> None:
        self._namespaces.pop(request_id, None)
        self._stored.pop(request_id, None)
        self._expected.pop(request_id, None)
        self._digested.discard(request_id)


# -- worker side ------------------------------------------------------------------------------------
class _WorkerSide(PoolWorkerSide):
    STATS = PdLMCacheStats

    def __init__(self, connector: PdLMCacheConnector) -> None:
        super().__init__()
        self.c = connector
        self.lookup_server: LookupServer | None = None
        self.verifier: BlockVerifier | None = None  # verify_kv on: digests of our paged blocks

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        c = self.c
        layers = [kv_caches[n] for n in c.layout.layer_names]
        if isinstance(c.pool, HeadGroupPools) and len(c.pool.groups) > 1:
            require_heads_outermost(layers, c.kv_cache_config.num_blocks,
                                    c.kv_cache_config.kv_cache_groups[0].kv_cache_spec,
                                    "PdLMCacheConnector")
        c.pool.attach_kv(layers, c.kv_cache_config.num_blocks)
        if c.options.verify_kv != "off":
            try:
                self.verifier = BlockVerifier(layers, c.kv_cache_config.num_blocks)
            except ValueError as exc:
                logger.warning("PdLMCacheConnector: KV blocks cannot be digested (%s): loads "
                               "are unverified, prefills state no digests", exc)
        if c.lookup_address is not None:  # the scheduler asks this process's LMCache engine
            self.lookup_server = LookupServer(
                c.lookup_address, lambda message: c.pool.lookup(*split_lookup_message(message)))

    def close(self) -> None:
        if self.lookup_server is not None:
            self.lookup_server.close()

    def start_load_kv(self, meta: PdLMCacheMetadata) -> None:
        bs = self.c.block_size
        for op in meta.retrieves:
            start = time.perf_counter()
            got = self.c.pool.retrieve(op.tokens, op.block_ids, skip_tokens=op.skip_tokens,
                                       namespace=op.namespace)
            self.stats.count("retrieve_seconds", time.perf_counter() - start)
            self.stats.count("retrieved_tokens", max(0, got - op.skip_tokens))
            lost = 0
            if got < op.needed_tokens:
                first_bad = max(got, op.skip_tokens) // bs
                lost = len(self._fail(op, first_bad))
                self.stats.count("failed_tokens", op.needed_tokens - max(got, op.skip_tokens))
                logger.warning("PdLMCacheConnector: request %s: retrieved %d of %d prompt tokens "
                               "from %s", op.req_id, got, op.needed_tokens, self.c.options.backend)
            if self.c.options.verify_kv != "off":
                self._verify(op, got, lost)

    def _fail(self, op: RetrieveOp, first_bad: int) -> list[int]:
        """Blocks first_bad.. of the load are not used (vLLM recomputes or fails them)."""
        bad = op.block_ids[first_bad:-(-op.needed_tokens // self.c.block_size)]
        self.fail_blocks(op.req_id, bad)
        return bad

    def _verify(self, op: RetrieveOp, got: int, lost: int) -> None:
        """Checks the retrieved blocks vLLM will use against the prefill's digests."""
        bs = self.c.block_size
        first, n = loaded_blocks(op, bs)
        landed = op.block_ids[first:first + n - lost]  # retrieved and counted on
        self._inject_corrupt(op, landed)
        checked = (op.expected is not None and self.verifier is not None
                   and len(op.expected) >= len(landed))  # the scheduler sends enough
        if not checked or not landed:
            self.record_load(op.req_id, LoadOutcome(n, lost, 0, checked))
            return
        expected = np.asarray(op.expected[:len(landed)], dtype=np.uint64)
        found = self.verifier.digests(landed)
        k = first_mismatch(found, expected)
        if k is None:
            self.record_load(op.req_id, LoadOutcome(n, lost, 0, True))
            return
        mismatched = int(np.count_nonzero(found != expected))
        failed = len(self._fail(op, first + k))
        logger.error("PdLMCacheConnector: request %s: %d of %d blocks retrieved from %s do not "
                     "match the prefill's digests (first: block %d of the load); blocks from "
                     "there are not used (kv_load_failure_policy)", op.req_id, mismatched,
                     len(landed), self.c.options.backend, k)
        self.record_load(op.req_id, LoadOutcome(n, failed, mismatched, True))

    def _inject_corrupt(self, op: RetrieveOp, landed: list[int]) -> None:
        """Fault `corrupt`: one byte of one retrieved block, before the check."""
        faults = self.c.faults
        if not faults.enabled or not landed or self.verifier is None:
            return
        rule = faults.take("corrupt", op.req_id)
        if rule is not None:
            self.verifier.damage(landed[position(rule, op.req_id, len(landed))],
                                 position(rule, op.req_id + "/byte", self.verifier.block_bytes))
            self.stats.count(FAULTS_INJECTED_KEY)

    def wait_for_save(self, meta: PdLMCacheMetadata) -> None:
        try:
            self._save(meta)
        finally:
            self.end_step()  # this step's failed loads concern this step's stores only

    def _save(self, meta: PdLMCacheMetadata) -> None:
        due: dict[str, list[int] | None] = {}
        for op in meta.stores:
            own = self.own_blocks(op.req_id, op.block_ids)
            if own < len(op.block_ids):  # a load of this prompt failed: its own chunks only
                op = self._own_chunks(op, own)
                if op is None:
                    continue
            start = time.perf_counter()
            self.stats.count("stored_tokens", self.c.pool.store(
                op.tokens, self._stale_chunk(op), op.namespace))
            self.stats.count("store_seconds", time.perf_counter() - start)
            if op.digest:  # ours: computed, or loaded by this leg (lookup); None where this
                # worker cannot digest, so that its scheduler does not wait for them
                due[op.req_id] = op.block_ids if self.verifier is not None else None
        if due:
            self.c.digests.send(self.verifier, due)

    def _own_chunks(self, op: StoreOp, own_blocks: int) -> StoreOp | None:
        """`op` cut to the whole chunks before its request's first failed load block, without
        digests (the scheduler stores the rest, and digests, once vLLM has recomputed it)."""
        tokens = own_blocks * self.c.block_size // self.c.chunk_size * self.c.chunk_size
        self.stats.count("unstored_tokens", len(op.tokens) - tokens)
        logger.warning("PdLMCacheConnector: request %s: %d prompt tokens not stored (a load of "
                       "this prompt failed: they are not its KV)", op.req_id, len(op.tokens) - tokens)
        if not tokens:
            return None
        return StoreOp(op.req_id, op.tokens[:tokens], op.block_ids[:tokens // self.c.block_size],
                       op.namespace, digest=False)

    def _stale_chunk(self, op: StoreOp) -> list[int]:
        """The blocks to store `op` from: its own, except under fault `stale_chunk`, where one
        chunk of a targeted prompt comes from other blocks (another prompt's KV, or none yet),
        so the pool holds KV under this prompt's key that is not this prompt's."""
        faults = self.c.faults
        per_chunk = self.c.chunk_size // self.c.block_size
        chunks = len(op.block_ids) // per_chunk
        if not faults.enabled or not chunks:
            return op.block_ids
        rule = faults.take("stale_chunk", op.req_id)
        if rule is None:
            return op.block_ids
        chunk = position(rule, op.req_id, chunks)
        own = set(op.block_ids)
        others = [b for b in range(1, self.c.kv_cache_config.num_blocks) if b not in own]
        ids = list(op.block_ids)
        ids[chunk * per_chunk:(chunk + 1) * per_chunk] = others[:per_chunk]
        self.stats.count(FAULTS_INJECTED_KEY)
        return ids


class PdLMCacheConnector(SyncPoolConnector):
    STATS = PdLMCacheStats
    OPTIONS = LMCacheOptions
    PROM_METRICS = PdLMCachePromMetrics

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        self.chunk_size = self.options.chunk_size or self.block_size
        head_groups = self.options.head_groups
        in_server = self.options.backend.startswith("mp://")
        if head_groups is not None and in_server:
            raise ValueError("PdLMCacheConnector: head_groups works with the backends an engine "
                             "opens itself (fs://, redis://, lm://), not with an LMCache server "
                             "(mp://), which reads whole blocks from the engine's memory")
        self.layout = kv_layout(vllm_config, kv_cache_config, "pd-lmcache v1",
                                "PdLMCacheConnector", head_groups=head_groups)
        par = vllm_config.parallel_config
        self.world_size = par.world_size
        dtype = kv_cache_config.kv_cache_groups[0].kv_cache_spec.dtype
        # refused at start unless allowed (transfer/kv_faults.py), in every process of the engine
        self.faults = KvFaults.from_spec(
            extra_options(KvFaultOptions, vllm_config.kv_transfer_config,
                          "PdLMCacheConnector").faults, "PdLMCacheConnector")
        # the prefill's digests, worker -> scheduler (one TP rank: a TP > 1 prefill states none,
        # its decodes load unverified)
        self.digests: DigestChannel | None = None
        if self.stores and self.options.verify_kv != "off" and par.world_size == 1:
            self.digests = DigestChannel(self.engine_id,
                                         scheduler=role == KVConnectorRole.SCHEDULER)

        def pool(place: int = par.rank, places: int = par.world_size, name: str = ""):
            """The pool of chunks stored as worker `place` of `places` (this rank, or one head
            group)."""
            return open_pool(
                self.options, self.layout.description, len(self.layout.layer_names),
                self.block_size, self.layout.page_bytes // dtype.itemsize, dtype, place, places,
                instance_id=f"pd-lmcache-{self.engine_id}-{par.rank}{name}")

        # The worker owns the KV store; the scheduler only looks prompts up. An LMCache server
        # (mp://) answers both itself; an LMCache engine inside the worker (every other backend:
        # its CPU tier may hold what the remote does not) is asked over a lookup channel.
        self.lookup_address = None if in_server else lookup_address(self.engine_id, par.rank)
        self.pool: LMCacheClient | None = None  # worker side
        self.lookups: LMCacheClient | RanksLookup | None = None  # scheduler side
        if role == KVConnectorRole.WORKER and head_groups is not None:
            self.pool = HeadGroupPools(
                groups_of_rank(head_groups, par.tensor_parallel_size, par.rank),
                lambda group: pool(group, head_groups, f"-g{group}"))
        elif role == KVConnectorRole.WORKER:
            self.pool = pool()
        elif in_server:
            self.lookups = pool()
        else:  # every rank's worker: a chunk counts when each rank holds its part
            self.lookups = RanksLookup([lookup_address(self.engine_id, rank)
                                        for rank in range(par.world_size)],
                                       self.options.timeout_s)
        if self.stores and not self.options.shared:
            logger.warning("PdLMCacheConnector: backend %s is this engine's own: a decode on "
                           "another engine cannot read what this prefill stores (use one of %s)",
                           self.options.backend, ", ".join(SHARED_LMCACHE_BACKENDS))
        logger.info("PdLMCacheConnector (%s, %s): backend %s, chunks of %d tokens",
                    vllm_config.kv_transfer_config.kv_role, role.name, self.options.backend,
                    self.chunk_size)
        self._scheduler = _SchedulerSide(self) if role == KVConnectorRole.SCHEDULER else None
        self._worker = _WorkerSide(self) if role == KVConnectorRole.WORKER else None

    def lookup(self, tokens: list[int], namespace: str) -> int:
        """Scheduler side: leading prompt tokens the pool holds under this namespace."""
        if isinstance(self.lookups, RanksLookup):
            return self.lookups.lookup(lookup_message(tokens, namespace))
        return self.lookups.lookup(tokens, namespace)

    # -- worker side -------------------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # chunks are stored after the step (wait_for_save)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata())

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        for part in (self.pool, self.lookups, self.digests):
            if part is not None:
                part.close()
