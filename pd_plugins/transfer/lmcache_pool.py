"""A KV pool backed by an LMCache engine in this process: prefix chunks in local CPU memory, a
local disk, a shared directory, an `lmcache_server` or Redis. Engine-agnostic (torch only).

A chunk (`chunk_size` tokens, whole blocks) is keyed by a prefix hash of its tokens plus the
engine's layout fingerprint (`layout`, passed to LMCache as the model name), rank and dtype, so
engines whose layouts differ never read each other's chunks, and by the request's `namespace`
(an LMCache key tag): what besides the tokens decides the KV (LoRA adapter, cache salt,
multimodal inputs; the vLLM connector derives it), so such requests only meet their own kind.

What this wrapper adds to LMCache:
- Keys that agree across processes. LMCache's default hash is Python's `hash()` and its root hash
  comes from vLLM's `NONE_HASH`, seeded from PYTHONHASHSEED (hence "needs PYTHONHASHSEED=0").
  Here chunk keys are SHA-256 over the token ids from a fixed root, whatever the seed.
- Bounded calls. LMCache waits without a timeout on some remote calls (`contains`), so each call
  runs in a daemon thread and is abandoned after `timeout_s`; a `CopyTicket` guarantees that an
  abandoned call copies nothing into or out of blocks the engine may have reused. While an
  abandoned call is still stuck, further calls fail fast.
- Failures as zeros and warnings, never exceptions: a remote backend that is unreachable (a
  cheap TCP/directory probe) counts as down; `store` returns only tokens the backend verifiably
  holds (remote puts are awaited, then checked).
- A shutdown that cannot hang. LMCache's Redis connector deadlocks in close(): the coroutine
  `RedisConnector.close` calls its job executor's *blocking* `shutdown()`, which waits on the event
  loop thread for a coroutine scheduled on that same loop. The loop thread (not a daemon) then
  never ends, so neither does the process. Here that executor's `shutdown` is replaced by a
  non-blocking one, LMCache's close runs in a daemon thread with a time limit, then its event
  loop is stopped; an interpreter-exit hook closes pools nobody closed.
- Shared engines: pools with the same `instance_id` in one process share one LMCache engine,
  reference counted. (vLLM's scheduler runs in another process than its worker: PdLMCacheConnector
  asks the worker's pool over transfer/lookup_channel.py.)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence
from urllib.parse import urlparse

import numpy as np
import torch

from pd_plugins.transfer.lmcache_cpu_connector import CopyTicket, CPUPagedKVConnector
from pd_plugins.transfer.paged_kv import block_dim

logger = logging.getLogger(__name__)

BACKEND_FORMS = "cpu, disk:///abs/path, fs:///abs/path, lm://host:port, redis://host:port[/db]"
DISK_GB = 8.0          # local disk backend capacity
CLOSE_TIMEOUT_S = 3.0  # LMCache's close beyond this is presumed deadlocked
PROBE_TTL_S = 1.0      # a reachability probe's answer is reused this long
ROOT_HASH = 0          # prefix hash "before" the first chunk, the same in every process
NAMESPACE_TAG = "lmcache.tag.pd_ns"  # a key tag: part of every chunk key (and its remote name)


def _request_configs(namespace: str) -> dict[str, str] | None:
    return {NAMESPACE_TAG: namespace} if namespace else None


def parse_backend(backend: str) -> tuple[dict[str, Any], tuple[str, int] | str | None]:
    """LMCache config entries for `backend`, and what to probe for reachability (an address,
    a directory, or None for process-local backends)."""
    url = urlparse(backend)
    if backend == "cpu":
        return {}, None
    if url.scheme in ("disk", "fs") and url.path.startswith("/") and not url.netloc:
        if url.scheme == "disk":
            return {"local_disk": f"file://{url.path}", "max_local_disk_size": DISK_GB}, None
        # LMCache's URL parser insists on host:port even for fs://, then ignores them
        return {"remote_url": f"fs://localhost:0{url.path}"}, url.path
    db = url.path if url.scheme == "redis" and url.path[1:].isdigit() else ""
    if url.scheme in ("lm", "redis") and url.hostname and url.port and url.path in ("", "/", db):
        address = (url.hostname, url.port)
        return {"remote_url": f"{url.scheme}://{url.hostname}:{url.port}{db}"}, address
    raise ValueError(f"unknown LMCache pool backend {backend!r}; accepted: {BACKEND_FORMS}")


@dataclass
class PoolStats:
    stored_tokens: int = 0
    retrieved_tokens: int = 0
    stored_bytes: int = 0
    retrieved_bytes: int = 0
    store_seconds: float = 0.0
    retrieve_seconds: float = 0.0
    lookup_errors: int = 0
    store_errors: int = 0
    retrieve_errors: int = 0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _stable_token_database(config, metadata):
    """LMCache's chunked token database with SHA-256 chunk keys from a fixed root (see top)."""
    from lmcache.v1.token_database import ChunkedTokenDatabase

    class StableTokenDatabase(ChunkedTokenDatabase):
        def _get_init_hash(self) -> int:
            return ROOT_HASH

        def _hash_tokens(self, tokens, prefix_hash=None, extra_keys=None) -> int:
            ids = np.asarray(tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens,
                             dtype=np.int64)
            digest = hashlib.sha256(int(prefix_hash or ROOT_HASH).to_bytes(8, "big", signed=True)
                                    + ids.tobytes() + repr(extra_keys or ()).encode()).digest()
            return int.from_bytes(digest[:8], "big", signed=True)

    # LMCache's constructor re-initialises vLLM's own NONE_HASH: keep vLLM's as it was
    try:
        from vllm.v1.core import kv_cache_utils as vllm_hashes
    except ImportError:
        vllm_hashes = None
    saved = {n: getattr(vllm_hashes, n) for n in ("NONE_HASH", "_NONE_HASH_SEED")
             if hasattr(vllm_hashes, n)}
    try:
        return StableTokenDatabase(config, metadata)
    finally:
        for name, value in saved.items():
            setattr(vllm_hashes, name, value)


class _SharedEngine:
    """One LMCache engine and what the pools sharing it need."""

    def __init__(self, signature: tuple, engine, connector: CPUPagedKVConnector) -> None:
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        self.signature, self.engine, self.connector, self.refs = signature, engine, connector, 0
        backends = engine.storage_manager.storage_backends.values()
        self.remote = next((b for b in backends if isinstance(b, RemoteBackend)), None)
        self.defuse_remote_close()
        self.stuck: threading.Event | None = None  # set when an abandoned call finishes
        self.probe_at, self.probe_ok = 0.0, True

    def defuse_remote_close(self) -> None:
        """Makes the remote connector's job executor shut down without blocking its own loop."""
        connection = self.remote.connection if self.remote is not None else None
        inner = getattr(connection, "getWrappedConnector", lambda: connection)()
        executor = getattr(inner, "pq_executor", None)
        if executor is not None and "shutdown" not in vars(executor):
            executor.shutdown = lambda wait=True: asyncio.ensure_future(
                executor.shutdown_async(wait=False), loop=executor.loop)

    def reconnect(self) -> None:
        """LMCache connects to a remote backend once, at start; connect when it comes up."""
        if self.remote is not None and self.remote.connection is None:
            self.remote.init_connection()  # LMCache retries at most every 10 s
            self.defuse_remote_close()


_ENGINES: dict[str, _SharedEngine] = {}
_ENGINES_LOCK = threading.Lock()


def _with_socket_timeouts(backend_config: dict, timeout_s: float) -> dict:
    """redis-py waits forever on a hung server unless its URL says otherwise; give up a little
    before the pool does, so that LMCache's call ends rather than being abandoned."""
    url, limit = backend_config.get("remote_url", ""), round(0.8 * timeout_s, 3)
    if url.startswith("redis://"):
        url += f"?socket_timeout={limit}&socket_connect_timeout={limit}"
        return {**backend_config, "remote_url": url}
    return backend_config


def _build_engine(backend_config: dict, instance_id: str, model_name: str, num_layers: int,
                  chunk_size: int, token_elems: int, kv_dtype: torch.dtype, rank: int,
                  world_size: int, local_cpu_gb: float, timeout_s: float,
                  connector: CPUPagedKVConnector):
    from lmcache.v1.cache_engine import LMCacheEngine
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    config = LMCacheEngineConfig.from_dict({
        "chunk_size": chunk_size, "local_cpu": True, "max_local_cpu_size": local_cpu_gb,
        "save_unfull_chunk": False, "remote_serde": "naive", "lmcache_instance_id": instance_id,
        "pre_caching_hash_algorithm": "sha256_cbor",  # replaced by our own keys, quiets a warning
        "blocking_timeout_secs": max(1, int(timeout_s)),
        **_with_socket_timeouts(backend_config, timeout_s)})
    # a chunk is [1, layers, tokens, elements per token]: whole blocks in the engine's order
    metadata = LMCacheMetadata(
        model_name=model_name, world_size=world_size, local_world_size=world_size,
        worker_id=rank, local_worker_id=rank, kv_dtype=kv_dtype,
        kv_shape=(num_layers, 1, chunk_size, 1, token_elems), role="worker",
        chunk_size=chunk_size)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no usage reports from a server
    start_method = multiprocessing.get_start_method(allow_none=True)
    try:
        engine = LMCacheEngine(config, metadata, _stable_token_database(config, metadata),
                               connector, lambda *a: None, lambda obj, *a: obj)
        engine.post_init()
    finally:  # LMCacheEngine forces "spawn" process-wide
        multiprocessing.set_start_method(start_method, force=True)
    return engine


def _close_engine(instance_id: str, shared: _SharedEngine) -> None:
    closer = threading.Thread(target=shared.engine.close, name=f"lmcache-close-{instance_id}",
                              daemon=True)
    closer.start()
    closer.join(CLOSE_TIMEOUT_S)
    manager = shared.engine.storage_manager
    if closer.is_alive():
        logger.warning("LMCache pool %s: LMCache's close did not finish in %.0fs (its remote "
                       "connector's shutdown is stuck); stopping its event loop", instance_id,
                       CLOSE_TIMEOUT_S)
    if manager is not None and manager.thread.is_alive():
        manager.loop.call_soon_threadsafe(manager.loop.stop)
        manager.thread.join(1.0)


def _close_all_at_exit() -> None:
    with _ENGINES_LOCK:
        leftovers = list(_ENGINES.items())
        _ENGINES.clear()
    for instance_id, shared in leftovers:
        _close_engine(instance_id, shared)


# runs before the interpreter joins non-daemon threads (LMCache's event loop is one)
getattr(threading, "_register_atexit", lambda fn: None)(_close_all_at_exit)


class LMCachePool:
    """Prefix chunks of KV in an LMCache engine: lookup, store and retrieve by token ids
    (an LMCacheClient, lmcache_client.py)."""

    def __init__(self, backend: str, *, layout: str, num_layers: int, block_size: int,
                 chunk_size: int, kv_dtype: torch.dtype, layer_block_shape: tuple[int, ...],
                 rank: int = 0, world_size: int = 1, local_cpu_gb: float = 0.5,
                 timeout_s: float = 5.0, instance_id: str | None = None) -> None:
        if chunk_size <= 0 or chunk_size % block_size:
            raise ValueError(f"chunk_size {chunk_size} is not a multiple of block_size "
                             f"{block_size}")
        backend_config, self._probe_target = parse_backend(backend)
        self.backend, self.block_size, self.chunk_size = backend, block_size, chunk_size
        self.timeout_s, self.stats = timeout_s, PoolStats()
        self.instance_id = instance_id or f"pd-lmcache-{uuid.uuid4().hex[:12]}"
        self._layers: list[torch.Tensor] | None = None
        self._last_warning: dict[str, float] = {}
        model_name = "pd-" + hashlib.sha256(layout.encode()).hexdigest()[:24]
        signature = (backend, model_name, num_layers, block_size, chunk_size, kv_dtype,
                     tuple(layer_block_shape), rank, world_size)
        with _ENGINES_LOCK:
            shared = _ENGINES.get(self.instance_id)
            if shared is None:
                connector = CPUPagedKVConnector(num_layers, block_size, layer_block_shape,
                                                kv_dtype)
                engine = _build_engine(backend_config, self.instance_id, model_name, num_layers,
                                       chunk_size, connector.token_elems, kv_dtype, rank,
                                       world_size, local_cpu_gb, timeout_s, connector)
                shared = _ENGINES[self.instance_id] = _SharedEngine(signature, engine, connector)
            elif shared.signature != signature:
                raise ValueError(f"LMCache pool {self.instance_id} is already open with another "
                                 f"backend or layout")
            shared.refs += 1
        self._shared: _SharedEngine | None = shared

    def attach_kv(self, layers: list[torch.Tensor], num_blocks: int) -> None:
        """Worker side: the engine's per-layer KV tensors (block dim 0 or 1, see
        paged_kv.block_dim)."""
        views = [t.movedim(block_dim(t, num_blocks), 0) for t in layers]
        self._live().connector.check_layers(views)
        self._layers = views

    def lookup(self, tokens: Sequence[int], namespace: str = "") -> int:
        """Leading tokens held, in whole chunks. With the remote backend down: a warning, and
        only what this process's own CPU/disk tier holds (0 for anything it did not store)."""
        full = self._full_chunks(len(tokens))
        if full == 0:
            return 0
        engine, configs = self._live().engine, _request_configs(namespace)
        hit = self._bounded("lookup", lambda: engine.lookup(list(tokens[:full]),
                                                            request_configs=configs))
        if hit is None:  # failed or timed out: warned
            self.stats.lookup_errors += 1
            return 0
        if hit < full and not self._reachable():
            self.stats.lookup_errors += 1
            self._warn("lookup", f"{self.backend} unreachable: lookups see this process's "
                                 f"own copies only")
        return hit

    def store(self, tokens: Sequence[int], block_ids: Sequence[int], namespace: str = "") -> int:
        """Stores the full chunks not yet held; returns the tokens newly stored (0 on failure)."""
        engine, configs = self._worker_engine(), _request_configs(namespace)
        full = self._full_chunks(min(len(tokens), len(block_ids) * self.block_size))
        if full == 0:
            return 0
        if not self._reachable():
            self.stats.store_errors += 1
            self._warn("store", f"store skipped: {self.backend} unreachable")
            return 0
        chunk_tokens, started = list(tokens[:full]), time.perf_counter()
        ticket, progress = CopyTicket(), {}

        def run() -> int:
            present = engine.lookup(chunk_tokens, request_configs=configs)
            if present >= full:
                return 0
            mask = torch.ones(full, dtype=torch.bool)
            mask[:present] = False
            engine.store(chunk_tokens, mask=mask, block_ids=list(block_ids), layers=self._layers,
                         ticket=ticket, progress=progress, request_configs=configs)
            return self._await_remote(chunk_tokens, present, progress.get("tokens", 0), started,
                                      configs)

        stored = self._bounded("store", run, ticket)
        self.stats.store_seconds += time.perf_counter() - started
        if stored is None:
            self.stats.store_errors += 1
            return 0
        self.stats.stored_tokens += stored
        self.stats.stored_bytes += progress.get("bytes", 0) if stored else 0
        return stored

    def retrieve(self, tokens: Sequence[int], block_ids: Sequence[int],
                 skip_tokens: int = 0, namespace: str = "") -> int:
        """Loads the longest present run of chunks into `block_ids`, leaving tokens below
        `skip_tokens` alone; returns how many leading tokens are now valid: 0 on failure,
        `skip_tokens` if nothing further was present."""
        engine, configs = self._worker_engine(), _request_configs(namespace)
        if skip_tokens % self.block_size:
            raise ValueError(f"skip_tokens {skip_tokens} is not a multiple of {self.block_size}")
        full = self._full_chunks(min(len(tokens), len(block_ids) * self.block_size))
        if full <= skip_tokens:
            return skip_tokens
        started, ticket, progress = time.perf_counter(), CopyTicket(), {}
        mask = torch.ones(full, dtype=torch.bool)
        mask[:skip_tokens - skip_tokens % self.chunk_size] = False  # chunks wholly skipped

        def run() -> int:
            got = engine.retrieve(list(tokens[:full]), mask=mask, block_ids=list(block_ids),
                                  skip_tokens=skip_tokens, layers=self._layers, ticket=ticket,
                                  progress=progress, request_configs=configs)
            loaded = got & mask
            return int(loaded.nonzero().max()) + 1 if loaded.any() else skip_tokens

        valid = self._bounded("retrieve", run, ticket)
        self.stats.retrieve_seconds += time.perf_counter() - started
        if valid is None:
            self.stats.retrieve_errors += 1
            return 0
        if valid < full and not self._reachable():
            self._warn("retrieve", f"retrieve found {valid} of {full} tokens; "
                                   f"{self.backend} unreachable")
        self.stats.retrieved_tokens += progress.get("tokens", 0)
        self.stats.retrieved_bytes += progress.get("bytes", 0)
        return max(valid, skip_tokens)

    def close(self) -> None:
        """Drops this pool's reference; the last one closes the engine (bounded, see top)."""
        shared, self._shared = self._shared, None
        if shared is None:
            return
        with _ENGINES_LOCK:
            shared.refs -= 1
            last = shared.refs == 0 and _ENGINES.get(self.instance_id) is shared
            if last:
                del _ENGINES[self.instance_id]
        if last:
            _close_engine(self.instance_id, shared)

    # -- helpers --------------------------------------------------------------------------------
    def _live(self) -> _SharedEngine:
        if self._shared is None:
            raise RuntimeError(f"LMCache pool {self.instance_id} is closed")
        return self._shared

    def _worker_engine(self):
        if self._layers is None:
            raise RuntimeError("attach_kv() first: store and retrieve are worker-side")
        return self._live().engine

    def _full_chunks(self, n: int) -> int:
        return n - n % self.chunk_size

    def _bounded(self, what: str, fn: Callable[[], Any], ticket: CopyTicket | None = None):
        """fn() in a daemon thread, given up after timeout_s; None when it failed or timed out."""
        shared = self._shared
        if shared.stuck is not None and not shared.stuck.is_set():
            self._warn(what, f"{what} skipped: an earlier LMCache call is still stuck")
            return None
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["value"] = fn()
            except BaseException as exc:  # reported to the caller below
                outcome["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, name=f"lmcache-{what}", daemon=True).start()
        if not done.wait(self.timeout_s):
            if ticket is not None:
                ticket.cancel()  # from here on, the abandoned call copies nothing
            shared.stuck = done
            self._warn(what, f"{what} timed out after {self.timeout_s:.1f}s ({self.backend})")
            return None
        if "error" in outcome:
            self._warn(what, f"{what} failed ({self.backend}): {outcome['error']!r}")
            return None
        return outcome["value"]

    def _await_remote(self, tokens: list[int], present: int, copied: int, started: float,
                      configs: dict[str, str] | None = None) -> int:
        """Tokens newly stored; for a remote backend only once it holds every new chunk (its
        puts are asynchronous, and a failed put is only logged by LMCache)."""
        remote = self._shared.remote
        if remote is None or copied == 0:
            return copied
        database = self._shared.engine.token_database
        keys = [key for start, _, key in database.process_tokens(tokens, request_configs=configs)
                if start >= present]
        while remote.batched_contains(keys) < len(keys):
            if not self._reachable(fresh=True):
                raise ConnectionError(f"{self.backend} went down while storing")
            if time.perf_counter() - started > 0.8 * self.timeout_s:
                raise TimeoutError(f"{self.backend} does not hold the stored chunks")
            time.sleep(0.005)
        return copied

    def _reachable(self, fresh: bool = False) -> bool:
        """Whether the remote backend answers (cached for PROBE_TTL_S); local ones always do."""
        target, shared = self._probe_target, self._shared
        if target is None:
            return True
        now = time.monotonic()
        if not fresh and now - shared.probe_at < PROBE_TTL_S:
            return shared.probe_ok
        if isinstance(target, str):
            ok = os.path.isdir(target) and os.access(target, os.W_OK)
        else:
            try:
                socket.create_connection(target, timeout=min(1.0, self.timeout_s)).close()
                ok = True
            except OSError:
                ok = False
        shared.probe_at, shared.probe_ok = now, ok
        if ok:
            shared.reconnect()
        return ok

    def _warn(self, kind: str, message: str) -> None:
        """A warning per kind at most every 10 s (a down backend fails every call)."""
        now = time.monotonic()
        if now - self._last_warning.get(kind, -1e9) >= 10.0:
            self._last_warning[kind] = now
            logger.warning("LMCache pool %s: %s", self.instance_id, message)
