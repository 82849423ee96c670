"""A client of LMCache's multiprocess ("MP") cache server, for vLLM connectors on CPU machines.

The server (`lmcache server ... --supported-transfer-mode lmcache_driven`, see
pd_plugins/testing/lmcache_mp_server.py) holds the KV cache; engines are clients over ZMQ. In the
`lmcache_driven` mode used here the worker registers its paged KV tensors once; on CPU, LMCache
moves each tensor's storage into a POSIX shared-memory segment (re-pointing the tensor in place)
and the server maps that segment and copies blocks itself, so a store or retrieve is one request.

Keys: LMCache hashes token chunks (blake3, process independent) under a model name; the model
name here is a digest of the engine's layout fingerprint and KV geometry, so engines with
incompatible KV never see each other's chunks; a request's `namespace` (what besides the tokens
decides its KV: LoRA, cache salt, multimodal inputs) is the server's per-user cache salt, so
requests from different namespaces never see each other's chunks either. A lookup needs some
engine with the same fingerprint and world size to have registered its KV with the server (the
server resolves object keys through the registered layout); until then it answers 0.

Failure policy: no method raises on server errors; lookup/store/retrieve answer 0. Every call
waits at most about timeout_s. After a timeout the client turns unhealthy and answers 0 at once
while a background PING (a future polled on each call, no thread) probes the server; when it
answers, the worker's KV is registered again (a NOOP on a server that still has it) and work
resumes.

Caveats: attach_kv re-points the given tensors' storage at shared memory, so the engine must
use those very tensor objects (not other views of the same original storage). A retrieve that
times out may still be carried out by the server later, writing into its blocks. The server
skips storing chunks whose blocks are all its `--null-block-id` (default 0, vLLM's null block).
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import logging
import os
import threading
import time
import uuid
from typing import Any, Sequence
from urllib.parse import urlparse

import torch

from pd_plugins.transfer.paged_kv import block_dim

logger = logging.getLogger(__name__)

_instance_counter = itertools.count(1)


def mp_url_to_zmq(url: str) -> str:
    """`mp://host:port` (or `tcp://host:port`, or `host:port`) to the ZMQ endpoint."""
    if "://" not in url:
        url = "mp://" + url
    parsed = urlparse(url)
    if parsed.scheme not in ("mp", "tcp") or not parsed.hostname or not parsed.port:
        raise ValueError(f"expected mp://host:port, got {url!r}")
    return f"tcp://{parsed.hostname}:{parsed.port}"


def _layout_hint(bdim: int, layer_block_shape: tuple[int, ...], block_size: int) -> dict[str, str]:
    """LMCache's kv_layout hint for one layer's block shape (empty when it cannot tell)."""
    shape = tuple(layer_block_shape)
    if bdim == 0 and len(shape) == 3:  # vLLM CPU: [heads, block_size, 2*head_size] -> HND
        if shape[1] == block_size:
            return {"kv_layout": "HND"}
        if shape[0] == block_size:
            return {"kv_layout": "NHD"}
    if bdim == 1 and len(shape) >= 3:  # [2, num_blocks, block_size, heads, head_size]
        if shape[1] == block_size:
            return {"kv_layout": "NHD"}
        if len(shape) > 2 and shape[2] == block_size:
            return {"kv_layout": "HND"}
    return {}


# LMCache moves a registered KV cache into POSIX shared memory named /lmcache_kv_<pid>_<n>
# (platform/devices/cpu/shm.py) and unlinks it only when the tensors are collected or at a clean
# interpreter exit: an engine killed by a signal leaves its whole KV cache behind in /dev/shm.
SHM_DIR, SHM_PREFIX = "/dev/shm", "lmcache_kv_"


def _pid_alive(pid: int) -> bool:
    """In this PID namespace only: a segment's pid may be another container's (containers of one
    pod share /dev/shm, not PIDs), which is why a live owner also holds a lock on it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_kv_segments(directory: str = SHM_DIR) -> int:
    """Unlink the KV segments of processes that no longer run (the server's mappings, if any,
    stay valid); returns how many. Segments of live processes are never touched."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        pid = name[len(SHM_PREFIX):].split("_", 1)[0] if name.startswith(SHM_PREFIX) else ""
        path = os.path.join(directory, name)
        if pid.isdigit() and not _pid_alive(int(pid)) and not _locked(path):
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
    if removed:
        logger.info("removed %d LMCache KV segments of dead processes from %s", removed, directory)
    return removed


def _locked(path: str) -> bool:
    """Whether some live process holds `path` locked (hold_own_kv_segments), in any namespace."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False  # gone already, or not ours to judge: the unlink decides
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the probe's own lock


def hold_own_kv_segments(held: dict[str, int], directory: str = SHM_DIR) -> None:
    """Lock this process's KV segments not yet in `held` (name -> descriptor) for as long as
    the descriptors stay open: the kernel drops the locks when the process dies, however."""
    prefix = f"{SHM_PREFIX}{os.getpid()}_"
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if name.startswith(prefix) and name not in held:
            try:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            fcntl.flock(fd, fcntl.LOCK_SH)
            held[name] = fd


def remove_own_kv_segments(directory: str = SHM_DIR) -> None:
    """Unlink this process's KV segments (at close: the mappings stay valid until unmapped)."""
    prefix = f"{SHM_PREFIX}{os.getpid()}_"
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


class LMCacheMPClient:
    """Lookup / store / retrieve of paged KV against an LMCache MP server (an LMCacheClient,
    lmcache_client.py)."""

    def __init__(self, url: str, *, layout: str, num_layers: int, block_size: int,
                 chunk_size: int, kv_dtype: torch.dtype, layer_block_shape: tuple[int, ...],
                 rank: int = 0, world_size: int = 1, timeout_s: float = 5.0,
                 instance_id: str | None = None) -> None:
        if block_size <= 0 or chunk_size <= 0 or chunk_size % block_size:
            raise ValueError(f"chunk_size {chunk_size} must be a multiple of block_size {block_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        import zmq
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.url = url
        self.zmq_url = mp_url_to_zmq(url)
        self.layout = layout
        self.num_layers = num_layers
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // block_size
        self.kv_dtype = kv_dtype
        self.layer_block_shape = tuple(int(x) for x in layer_block_shape)
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.block_bytes = (num_layers * torch.Size(self.layer_block_shape).numel()
                            * torch.empty((), dtype=kv_dtype).element_size())
        # the element count, not the shape: a scheduler-side client knows only the page size
        fingerprint = "|".join(map(str, (layout, num_layers, block_size, chunk_size, kv_dtype,
                                         torch.Size(self.layer_block_shape).numel())))
        self.model_name = "pd-" + hashlib.blake2b(fingerprint.encode(), digest_size=16).hexdigest()
        # the server keys registrations by an int; a pid-based one stays unique across processes
        if instance_id is None:
            self.instance_id = os.getpid() * 4096 + next(_instance_counter) % 4096
        else:
            digest = hashlib.blake2b(instance_id.encode(), digest_size=7).digest()
            self.instance_id = int.from_bytes(digest, "big")
        self.stats: dict[str, float] = dict(
            stored_tokens=0, retrieved_tokens=0, stored_bytes=0, retrieved_bytes=0,
            store_seconds=0.0, retrieve_seconds=0.0, lookup_errors=0)

        self.confirm_stores = True  # store() returns once a lookup sees the chunks (see below)
        self._lock = threading.RLock()  # one operation at a time on this client
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # close() never waits for undelivered requests
        self._client = RequestClientFactory.create(self.zmq_url, context=self._ctx)
        self._closed = False
        self._segment_locks: dict[str, int] = {}  # flocked KV segments (hold_own_kv_segments)
        self._usable = True  # False for good after a configuration mismatch
        # health: None = not yet handshaken; the handshake request is in flight from here on
        self._healthy: bool | None = None
        self._probe: Any = self._client.get_chunk_size()
        self._probe_sent = time.monotonic()
        self._kv: dict[str, torch.Tensor] | None = None
        self._transfer: Any = None
        self._hints: dict[str, str] = {}
        self._registered_at = 0.0

    # ------------------------------------------------------------------ health

    def _check_chunk_size(self, server_chunk: Any) -> bool:
        try:  # the server's answer: an int, or whatever a broken one (or another program) sent
            matches = int(server_chunk) == self.chunk_size
        except (TypeError, ValueError, OverflowError):
            matches = False
        if not matches:
            logger.error("LMCache MP server %s has chunk size %s, this client %d: disabled",
                         self.url, server_chunk, self.chunk_size)
            self._usable = False
            return False
        return True

    def _mark_down(self, what: str, err: BaseException | None = None) -> None:
        if self._healthy is not False:
            logger.warning("LMCache MP server %s unavailable (%s%s); answering 0 until it is back",
                           self.url, what, f": {err!r}" if err else "")
        self._healthy = False
        self._probe = None

    def _ready(self, deadline: float) -> bool:
        """Whether to talk to the server now; blocks only for the first handshake."""
        if self._closed or not self._usable:
            return False
        if self._healthy:
            if self._kv is not None and time.monotonic() - self._registered_at > 600:
                return self._register(deadline)  # refresh before the server's idle reaping
            return True
        if self._healthy is None:  # first use: wait for the handshake sent by __init__
            try:
                chunk = self._probe.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as err:
                self._mark_down("no answer to the first request", err)
                return False
            self._probe = None
            if not self._check_chunk_size(chunk):
                return False
            self._healthy = True
            return self._kv is None or self._register(deadline)
        # unhealthy: poll the probe without blocking, send a new one when it is stale
        now = time.monotonic()
        if self._probe is None or (not self._probe.query() and now - self._probe_sent > self.timeout_s):
            self._probe, self._probe_sent = self._client.get_chunk_size(), now
            return False
        try:
            if not self._probe.query():
                return False
            chunk = self._probe.result(timeout=0)
        except Exception:
            self._probe = None
            return False
        self._probe = None
        if not self._check_chunk_size(chunk):
            return False
        logger.info("LMCache MP server %s is back", self.url)
        self._healthy = True
        return self._kv is None or self._register(deadline)

    # ---------------------------------------------------------------- KV cache

    def attach_kv(self, layers: list[torch.Tensor], num_blocks: int) -> None:
        """Register the engine's per-layer paged KV tensors with the server.

        The tensors' storage is moved into POSIX shared memory in place (LMCache's CPU
        `lmcache_driven` path); a server that is down gets the registration when it is back."""
        if len(layers) != self.num_layers:
            raise ValueError(f"{len(layers)} KV layers, expected {self.num_layers}")
        bdims = {block_dim(t, num_blocks) for t in layers}
        if len(bdims) != 1:
            raise ValueError(f"KV layers disagree on the block dimension: {bdims}")
        bdim = bdims.pop()
        shapes = {tuple(t.movedim(bdim, 0).shape[1:]) for t in layers}
        if len(shapes) != 1:
            raise ValueError(f"KV layers disagree on the block shape: {shapes}")
        block_shape = shapes.pop()
        for t in layers:
            shape = tuple(t.movedim(bdim, 0).shape[1:])
            if (torch.Size(shape).numel() != torch.Size(self.layer_block_shape).numel()
                    or t.dtype != self.kv_dtype):
                raise ValueError(f"KV layer {tuple(t.shape)} {t.dtype} does not match block shape "
                                 f"{self.layer_block_shape} {self.kv_dtype} (block dim {bdim})")
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("LMCacheMPClient needs contiguous CPU KV tensors")
        from lmcache.v1.multiprocess.transfer_context import create_transfer_context

        remove_dead_kv_segments()  # what engines killed before us left behind

        with self._lock:
            self._kv = {f"layer.{i}": t for i, t in enumerate(layers)}
            self._hints = _layout_hint(bdim, block_shape, self.block_size)
            self._transfer = create_transfer_context(self._kv, instance_id=self.instance_id,
                                                     req_client=self._client,
                                                     mode="lmcache_driven")
            self._registered_at = 0.0
            self._ready(time.monotonic() + self.timeout_s)

    def _register(self, deadline: float) -> bool:
        from lmcache.utils import EngineType

        try:
            # a NOOP (liveness refresh) on a server that has this instance already
            self._transfer.register(self._kv, self.model_name, self.world_size,
                                    self.blocks_per_chunk,
                                    max(0.05, deadline - time.monotonic()),
                                    layout_hints=self._hints, engine_group_infos=[],
                                    engine_type=EngineType.VLLM)
        except Exception as err:
            self._mark_down("KV registration failed", err)
            return False
        finally:  # LMCache moves the KV into shared memory as it registers it
            hold_own_kv_segments(self._segment_locks)
        self._registered_at = time.monotonic()
        return True

    # --------------------------------------------------------------- requests

    def _key(self, tokens: Sequence[int], end: int, request_id: str, worker: bool,
             namespace: str = "") -> Any:
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        # the namespace (what besides the tokens decides the KV) is the server's per-user salt
        return IPCCacheServerKey(model_name=self.model_name, world_size=self.world_size,
                                 worker_id=self.rank if worker else None,
                                 token_ids=tuple(int(t) for t in tokens[:end]), start=0, end=end,
                                 request_id=request_id, num_kv_readers=1, cache_salt=namespace)

    def _wait(self, future: Any, deadline: float) -> Any:
        return future.result(timeout=max(0.0, deadline - time.monotonic()))

    def _lookup_locked(self, tokens: Sequence[int], end: int, request_id: str,
                       deadline: float, namespace: str = "") -> int:
        """LOOKUP + prefetch wait: chunks present (now read-locked on the server)."""
        key = self._key(tokens, end, request_id, worker=False, namespace=namespace)
        self._wait(self._client.lookup(key, self.world_size), deadline)
        left = max(0.0, deadline - time.monotonic())
        chunks = self._wait(self._client.wait_prefetch_status(request_id, left), deadline)
        if chunks is None:
            raise TimeoutError("prefetch still running at the deadline")
        return int(chunks)

    def _release(self, tokens: Sequence[int], hit_tokens: int, request_id: str,
                 deadline: float, namespace: str = "") -> None:
        """Drop the read locks of a lookup that is not followed by a retrieve, end the session."""
        if hit_tokens:
            key = self._key(tokens, hit_tokens, request_id, worker=False, namespace=namespace)
            self._wait(self._client.free_lookup_locks(key, self.world_size), deadline)
        self._client.end_session(request_id)  # fire and forget

    def _aligned(self, n: int) -> int:
        return n // self.chunk_size * self.chunk_size

    def _await_visible(self, tokens: Sequence[int], end: int, deadline: float,
                       namespace: str = "") -> None:
        """Wait (at most ~1 s, within the deadline) until a lookup sees a finished store.

        The server answers STORE before it commits the chunks: the commit is a host callback
        run by its DeviceHostFuncDispatcher thread, so a lookup right after a store can miss.
        Waiting here gives read-your-writes, which a PD handoff (store, then tell the decoder)
        relies on. Eviction (a small L1) can keep the full prefix from ever showing: then this
        gives up after the wait and the store still counts as done."""
        if not self.confirm_stores:
            return
        limit = min(deadline, time.monotonic() + 1.0)
        while True:
            rid = f"pd-confirm-{uuid.uuid4().hex}"
            try:
                hit = self._lookup_locked(tokens, end, rid, limit, namespace) * self.chunk_size
                self._release(tokens, hit, rid, limit, namespace)
            except Exception as err:  # the store itself succeeded; do not turn unhealthy here
                logger.debug("LMCache MP store confirmation: %r", err)
                return
            if hit >= end or time.monotonic() >= limit:
                return
            time.sleep(0.002)

    def lookup(self, tokens: Sequence[int], namespace: str = "") -> int:
        """Leading tokens present on the server (a multiple of chunk_size); 0 when it is down."""
        end = self._aligned(len(tokens))
        if end == 0:
            return 0
        with self._lock:
            deadline = time.monotonic() + self.timeout_s
            if not self._ready(deadline):
                self.stats["lookup_errors"] += 1
                return 0
            rid = f"pd-lookup-{uuid.uuid4().hex}"
            try:
                hit = self._lookup_locked(tokens, end, rid, deadline, namespace) * self.chunk_size
                self._release(tokens, hit, rid, deadline, namespace)
                return min(hit, end)
            except Exception as err:
                self.stats["lookup_errors"] += 1
                self._mark_down("lookup failed", err)
                return 0

    def store(self, tokens: Sequence[int], block_ids: Sequence[int], namespace: str = "") -> int:
        """Store the full chunks of tokens (tokens[i] in block block_ids[i // block_size]).
        Returns the tokens stored; 0 on any failure."""
        end = self._aligned(min(len(tokens), len(block_ids) * self.block_size))
        if end == 0:
            return 0
        with self._lock:
            if self._kv is None:
                raise RuntimeError("store() before attach_kv()")
            t0 = time.monotonic()
            deadline = t0 + self.timeout_s
            if not self._ready(deadline):
                return 0
            rid = f"pd-store-{uuid.uuid4().hex}"
            blocks = [int(b) for b in block_ids[:end // self.block_size]]
            try:
                event = self._transfer.create_recorded_event()
                future = self._transfer.submit_store(
                    rid, self._key(tokens, end, rid, worker=True, namespace=namespace),
                    self._kv, [blocks], event, self.blocks_per_chunk)
                ok = bool(self._wait(future, deadline))
            except Exception as err:
                self._mark_down("store failed", err)
                return 0
            finally:
                self._client.end_session(rid)
            if not ok:
                logger.warning("LMCache MP server refused a store of %d tokens", end)
                self._registered_at = 0.0  # maybe reaped: register again on the next call
                return 0
            self._await_visible(tokens, end, deadline, namespace)
            self.stats["stored_tokens"] += end
            self.stats["stored_bytes"] += len(blocks) * self.block_bytes
            self.stats["store_seconds"] += time.monotonic() - t0
            return end

    def retrieve(self, tokens: Sequence[int], block_ids: Sequence[int],
                 skip_tokens: int = 0, namespace: str = "") -> int:
        """Load the leading chunks present into block_ids, writing only tokens >= skip_tokens.
        Returns the leading tokens now valid (tokens below skip_tokens are taken as valid
        already); 0 on failure."""
        end = self._aligned(min(len(tokens), len(block_ids) * self.block_size))
        if end == 0:
            return 0
        with self._lock:
            if self._kv is None:
                raise RuntimeError("retrieve() before attach_kv()")
            t0 = time.monotonic()
            deadline = t0 + self.timeout_s
            if not self._ready(deadline):
                return 0
            rid = f"pd-retrieve-{uuid.uuid4().hex}"
            hit = 0
            try:
                hit = min(self._lookup_locked(tokens, end, rid, deadline, namespace)
                          * self.chunk_size, end)
                if hit <= skip_tokens:  # nothing to write: release the locks instead
                    self._release(tokens, hit, rid, deadline, namespace)
                    return hit
                blocks = [int(b) for b in block_ids[:hit // self.block_size]]
                event = self._transfer.create_recorded_event()
                future = self._transfer.submit_retrieve(
                    rid, self._key(tokens, hit, rid, worker=True, namespace=namespace), self._kv,
                    [blocks], event, self.blocks_per_chunk, int(max(0, skip_tokens)))
                ok = bool(self._wait(future, deadline))
            except Exception as err:
                if hit:
                    logger.warning("LMCache MP retrieve of %d tokens did not finish in time; the "
                                   "server may still write into blocks %s", hit,
                                   list(block_ids[:hit // self.block_size]))
                self._mark_down("retrieve failed", err)
                self._client.end_session(rid)
                return 0
            self._client.end_session(rid)
            if not ok:
                logger.warning("LMCache MP server failed a retrieve of %d tokens", hit)
                self._registered_at = 0.0
                return 0
            written = hit - min(hit, max(0, skip_tokens))
            self.stats["retrieved_tokens"] += written
            self.stats["retrieved_bytes"] += written // self.block_size * self.block_bytes
            self.stats["retrieve_seconds"] += time.monotonic() - t0
            return hit

    # ---------------------------------------------------------------- shutdown

    def close(self) -> None:
        """Unregister the KV (best effort, bounded wait) and close the sockets."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            transfer, self._transfer, self._kv = self._transfer, None, None
        if transfer is not None:
            try:
                if self._healthy:
                    future = transfer.unregister()
                    if future is not None:
                        future.result(timeout=min(1.0, self.timeout_s))
            except Exception as err:
                logger.debug("LMCache MP unregister: %r", err)
            try:
                transfer.close()
            except Exception as err:
                logger.debug("LMCache MP transfer close: %r", err)
        try:
            self._client.close()
        except Exception as err:
            logger.debug("LMCache MP client close: %r", err)
        if transfer is not None:
            remove_own_kv_segments()
        for fd in self._segment_locks.values():
            os.close(fd)
        self._segment_locks.clear()
        # LINGER 0 makes term() quick once every socket is closed; a daemon thread keeps a
        # socket some other code left open from hanging close()
        term = threading.Thread(target=self._term, name="lmcache-mp-zmq-term", daemon=True)
        term.start()
        term.join(timeout=1.0)

    def _term(self) -> None:
        try:
            self._ctx.term()
        except Exception as err:
            logger.debug("LMCache MP zmq term: %r", err)

    def __enter__(self) -> LMCacheMPClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
