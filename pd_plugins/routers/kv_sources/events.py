"""A vLLM worker's KV events (`--kv-events-config`), fed into the router's prefix index.

BlockStored events carry the tokens of each block, so the router computes its own block keys
(vocab/block_keys.py) and remembers which engine hash is which key; BlockRemoved (engine hashes
only) and AllBlocksCleared take them out again. The engine's hashes are never trusted as keys: the
router does not depend on the engine's hash algorithm or seed.

Events come from the network: a malformed one is counted and skipped (`EventRejected`), never
fatal to the subscriber, and the router binds an events socket on loopback (or a private ipc
path) unless the operator opts in to another address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from collections import OrderedDict
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from pd_plugins.routers.policy.prefix_index import PrefixIndex
from pd_plugins.vocab.block_keys import block_keys, prompt_root

log = logging.getLogger("pd_router.prefix_index")

# A bigger KV event batch is skipped undecoded: decoding costs the event loop up to ~0.2 s per
# MiB of nested empty arrays. vLLM sends one batch per engine step, about 12 bytes per token of
# blocks stored or evicted (16-token blocks). A step is not bounded by max_num_batched_tokens:
# a decode engine caches each pulled prompt whole in the step that admits it (one scheduled token
# each), so 32 prompts of 8k tokens make a 1.1 MiB batch; 8 MiB covers ~700k tokens of a step.
MAX_BATCH_BYTES = 8 << 20
# Only a memory bound: past it ZMQ drops the message and ends the connection, for good when the
# router connects (libzmq 4.3 does not reconnect after that protocol error; the subscription
# would hear nothing again). No vLLM step comes near it.
MAX_MESSAGE_BYTES = 16 << 20
# The smallest event vLLM sends (BlockRemoved with one integer hash) is 42 bytes, and a step's
# events are a few per request: a batch of more events than this is no engine's, and is skipped
# whole before its events are decoded.
MAX_BATCH_EVENTS = (1 << 20) // 40
MAX_HASH_BYTES = 64  # an engine block hash as bytes (vLLM's: 32-byte sha256); kept per block
RECEIVE_QUEUE = 16  # batches ZMQ queues per publisher before it drops (bind: any may connect)
REJECT_LOG_INTERVAL_S = 60.0  # at most one warning per subscriber this often for bad batches
# Missed batches asked for again from the engine's replay socket (`kv_events_replay`): the whole
# answer within this long, and at most this many batches (vLLM keeps its last 10,000 by default:
# `buffer_steps`); what does not come in time stays missed, as without a replay socket.
REPLAY_TIMEOUT_S = 2.0
MAX_REPLAYED = 10_000
REPLAY_ROUNDS = 16  # asks for what vLLM's replay socket dropped (it queues 1,000 unsent at most)
REPLAY_QUIET_S = 0.1  # a reply that pauses this long once begun has lost its rest
MAX_REPLAY_BYTES = 64 << 20  # what one replay may make the router hold
REPLAY_BACKOFF_S = 30.0  # after a replay that failed, gaps are only logged for this long
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end of a replay


class ReplayTooLarge(Exception):
    """A replay past MAX_REPLAYED batches or MAX_REPLAY_BYTES: read no further."""


def batch_number(frame: bytes) -> int:
    """A batch's sequence number, from its frame (vLLM: 8 bytes, big-endian, from 0)."""
    return int.from_bytes(frame[:8], "big")


class EventRejected(ValueError):
    """A KV event the index cannot use (wrong shape or types); the batch's others still apply."""


class EventApplier:
    """Applies one worker's vLLM KV events (as decoded from the wire) to the prefix index."""

    def __init__(self, index: PrefixIndex, worker_url: str) -> None:
        self.index, self.worker_url = index, worker_url
        # engine block hash -> the router's key; oldest first, bounded like the keys they map to
        self.engine_keys: OrderedDict[object, int] = OrderedDict()

    def apply(self, event: Any) -> None:
        """Apply one event; `EventRejected` if malformed, with the index unchanged."""
        if not isinstance(event, dict):
            raise EventRejected(f"an event must be a map, got {type(event).__name__}")
        kind = event.get("type")
        if kind == "BlockStored":
            self._stored(event)
        elif kind == "BlockRemoved":
            hashes = _engine_hashes(event.get("block_hashes"))
            keys = [self.engine_keys.pop(engine_hash, None) for engine_hash in hashes]
            self.index.remove_keys(self.worker_url, [key for key in keys if key is not None])
        elif kind == "AllBlocksCleared":
            self.forget_all()
        # other event types (vLLM adds some) carry nothing the index uses

    def forget_all(self) -> None:
        """The worker's cache as the index knew it is gone (cleared, or the engine restarted)."""
        self.index.forget_blocks(self.worker_url)
        self.engine_keys.clear()

    def _stored(self, event: dict) -> None:
        size, tokens = event.get("block_size"), event.get("token_ids")
        hashes = _engine_hashes(event.get("block_hashes"))
        if not (isinstance(size, int) and not isinstance(size, bool) and size > 0):
            raise EventRejected(f"BlockStored.block_size must be a positive integer, "
                                f"got {size!r:.40}")
        if not (isinstance(tokens, list) and len(tokens) >= len(hashes) * size
                and set(map(type, tokens)) <= {int}):  # in C: events come on the request loop
            raise EventRejected("BlockStored.token_ids must be a list of integers covering "
                                "every block")
        parent_hash = event.get("parent_block_hash")
        if parent_hash is not None:
            _engine_hashes([parent_hash])
        adapter = event.get("lora_name")  # a prompt under a LoRA adapter chains from its own root
        if adapter is not None and not isinstance(adapter, str):
            raise EventRejected("BlockStored.lora_name must be a string or null")
        # A block whose engine hash covers multimodal input or prompt embeddings is not indexed,
        # nor the blocks after it: their tokens alone would match another image's prompt. A
        # prompt's cache_salt roots its keys, as the router roots a salted request's.
        plain, salt = _plain_blocks(event.get("extra_keys"), adapter, parent_hash is None,
                                    len(hashes))
        parent = (prompt_root(adapter, salt) if parent_hash is None
                  else self.engine_keys.get(parent_hash))
        if parent is None:  # parent evicted or never seen: these blocks are unreachable
            return
        hashes = hashes[:plain]
        if not hashes:
            return
        keys = block_keys(tokens[:len(hashes) * size], size, parent)
        for engine_hash, key in zip(hashes, keys):
            self.engine_keys[engine_hash] = key
            self.engine_keys.move_to_end(engine_hash)
        while len(self.engine_keys) > self.index.capacity_blocks:
            self.engine_keys.popitem(last=False)
        self.index.hold(self.worker_url, keys)


def _plain_blocks(extra_keys: Any, adapter: str | None, first: bool, count: int
                  ) -> tuple[int, str | None]:
    """(how many of an event's blocks, from the first, the router can key, the prompt's
    cache_salt). vLLM publishes the extra keys of each block's hash untagged, one entry per block
    (kv_cache_utils.to_event_extra_keys): the LoRA name, multimodal (id, offset) pairs, the cache
    salt (on a prompt's first block, `first`), prompt-embedding digests. The router's keys cover
    tokens, the adapter and the salt: a block with anything else is not keyable, nor any after."""
    if extra_keys is None:
        return count, None
    if not isinstance(extra_keys, list):
        raise EventRejected("BlockStored.extra_keys must be a list or null")
    salt = None
    for i, entry in enumerate(extra_keys[:count]):
        if entry is None:
            continue
        if not isinstance(entry, list):
            raise EventRejected("BlockStored.extra_keys entries must be lists or null")
        rest = entry[1:] if adapter is not None and entry[:1] == [adapter] else entry
        if i == 0 and first and len(rest) == 1 and isinstance(rest[0], str):
            salt = rest[0]  # a string beside the adapter's name on a prompt's first block
        elif rest:
            return i, salt
    return count, salt


def _engine_hashes(value: Any) -> list:
    """An event's engine block hashes: vLLM sends ints or bytes (ExternalBlockHash)."""
    if not (isinstance(value, list) and all(  # msgpack's ints are 64-bit: bytes need the bound
            (isinstance(h, int) and not isinstance(h, bool))
            or (isinstance(h, bytes) and len(h) <= MAX_HASH_BYTES) for h in value)):
        raise EventRejected(f"block_hashes must be a list of integers or bytes (at most "
                            f"{MAX_HASH_BYTES} bytes each)")
    return value


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind_endpoint(endpoint: str, allow_any_host: bool) -> None:
    """Refuse to listen for KV events where another host could publish fake ones, unless the
    operator said so: tcp binds on loopback only, ipc (made private after the bind), inproc."""
    scheme, _, path = endpoint.partition("://")
    if scheme == "ipc" and path.startswith("@") and not allow_any_host:
        raise ValueError(f"kv_events bind:{endpoint}: an abstract ipc socket has no permissions "
                         "(any local user could publish to it); use a path in a private directory")
    if scheme in ("ipc", "inproc"):
        return
    if scheme != "tcp":
        raise ValueError(f"kv_events bind:{endpoint}: only tcp://, ipc:// or inproc:// "
                         "can be bound")
    host = urlsplit(endpoint).hostname or ""
    if not _is_loopback(host) and not allow_any_host:
        raise ValueError(
            f"kv_events bind:{endpoint} would accept KV events from any host that reaches "
            f"{host or '*'}; bind a loopback address (or an ipc:// path), or set the worker "
            "option kv_events_bind_any=true to accept them from the network")


def _bind_privately(sock: zmq.Socket, endpoint: str) -> None:
    """Bind; an ipc socket file is made accessible to this user only (umask during the bind,
    so no other user can connect before the chmod)."""
    if not endpoint.startswith("ipc://"):
        sock.bind(endpoint)
        return
    old = os.umask(0o177)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)
    os.chmod(endpoint[len("ipc://"):], 0o600)


class KvEventSubscriber:
    """Feeds one worker's vLLM KV events (ZMQ SUB) into the index until cancelled.

    vLLM binds its PUB socket only for wildcard (`tcp://*:5557`) or ipc endpoints and connects to
    any other. So `endpoint` is either where the engine binds (the router connects), or
    `bind:tcp://127.0.0.1:5557`: the router binds there and the engine's config names that address.

    `replay`: the engine's replay socket (its `replay_endpoint`, which it binds; the router
    connects). Batches missed (the first ones, when the router starts after the engine; those sent
    while the subscription was down) are then asked for again from the engine's buffer and applied
    in order before the batch that showed the gap.
    """

    def __init__(self, index: PrefixIndex, worker_url: str, endpoint: str, topic: str = "",
                 allow_any_host: bool = False, replay: str | None = None) -> None:
        self.index, self.worker_url, self.endpoint, self.topic = index, worker_url, endpoint, topic
        self.replay = replay
        self.batches_replayed = 0
        self._replay_after = float("-inf")  # no replay before this (loop time): REPLAY_BACKOFF_S
        if endpoint.startswith("bind:"):
            check_bind_endpoint(endpoint[5:], allow_any_host)  # at configuration time
        self.events = EventApplier(index, worker_url)
        self.events_applied = 0
        self.events_rejected = 0   # malformed events skipped (their batch's others applied)
        self.batches_rejected = 0  # undecodable batches skipped whole
        self.last_seq = -1
        self.sequence_gaps = 0  # batches whose number did not follow the last one's
        self._last_reject_log = float("-inf")

    async def run(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        try:
            if self.endpoint.startswith("bind:"):
                _bind_privately(sock, self.endpoint[5:])  # the engine connects to us
            else:
                sock.connect(self.endpoint)  # the engine binds (`tcp://*:PORT` in its config)
        except BaseException as exc:
            log.error("cannot subscribe to KV events of %s at %s: %s", self.worker_url,
                      self.endpoint, exc)
            sock.close(linger=0)
            raise
        self.index.exact_workers.add(self.worker_url)
        log.info("subscribed to KV events of %s at %s", self.worker_url, self.endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                if self.replay is not None and len(frames) == 3:
                    seq = batch_number(frames[1])
                    if seq > self.last_seq + 1:  # (from -1: the router started after the engine)
                        await self.replay_missed(seq)
                try:
                    self.handle(frames)
                except Exception as exc:  # a bug here must not end the subscription either
                    self.batches_rejected += 1
                    self._log_rejection(f"a batch could not be applied: {exc!r}", exc_info=True)
        finally:
            self.index.exact_workers.discard(self.worker_url)
            sock.close(linger=0)

    async def replay_missed(self, until: int) -> None:
        """Ask the engine's replay socket for the batches after the last one applied and before
        `until`, and apply those that come, in order. vLLM sends its whole buffer from there at
        once, with no flow control, and its ROUTER socket drops what overflows its send queue
        (1,000 messages) when its I/O falls behind (a loaded host): a hole after the first batch
        that came, or a tail dropped with the end marker (a reply that goes quiet for
        REPLAY_QUIET_S), is asked for again from the first batch missing, round after round
        while each round brings batches it lacked (at most REPLAY_ROUNDS). Everything is read
        (within REPLAY_TIMEOUT_S in all, MAX_REPLAYED batches and MAX_REPLAY_BYTES) before any
        is applied, and the event loop gets a turn every few batches either way. Never raises:
        what does not come stays missed (handle() logs the gap), and a replay that fails is not
        tried again for REPLAY_BACKOFF_S (each would hold the live batches back for up to the
        timeout)."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._replay_after:
            return
        batches: dict[int, list[bytes]] = {}
        start, size, problem = self.last_seq + 1, 0, None
        try:
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                for _ in range(REPLAY_ROUNDS):
                    had = len(batches)
                    size += await self._receive_replay(start, until, batches, size)
                    # older than the first that came: gone from the engine's buffer, not dropped
                    first = min(batches, default=until)
                    start = next((seq for seq in range(first, until) if seq not in batches), until)
                    if start == until:
                        break
                    if len(batches) == had:  # the engine no longer has what is missing
                        problem = f"batch {start} did not come"
                        break
                else:
                    problem = f"batches still missing after {REPLAY_ROUNDS} rounds"
        except (TimeoutError, zmq.ZMQError) as exc:
            problem = f"{exc!r}" if str(exc) else "no end within the timeout"
        except ReplayTooLarge as exc:
            problem = str(exc)
        if problem is not None:
            self._replay_after = loop.time() + REPLAY_BACKOFF_S
            self._log_rejection(f"replay from {self.replay} after batch {self.last_seq} ended "
                                f"early: {problem} ({len(batches)} batches kept)")
        for n, seq in enumerate(sorted(batches)):
            if seq > self.last_seq:  # (a batch numbered at or below the last is never replayed)
                try:
                    self.handle(batches[seq])
                except Exception as exc:  # as in run(): a bug must not end the subscription
                    self.batches_rejected += 1
                    self._log_rejection(f"a replayed batch could not be applied: {exc!r}",
                                        exc_info=True)
                self.batches_replayed += 1
            if n % 64 == 63:
                await asyncio.sleep(0)

    async def _receive_replay(self, start: int, until: int, batches: dict[int, list[bytes]],
                              size: int) -> int:
        """One replay request: the batches numbered `start` to `until - 1` that come, into
        `batches` (holding `size` payload bytes), until the engine's end marker, the last one
        needed, or a pause of REPLAY_QUIET_S once the reply has begun (vLLM sends a reply in one
        go: the rest was dropped). Returns the payload bytes added."""
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES + (64 << 10))  # larger: skipped anyway
        sock.setsockopt(zmq.RCVHWM, MAX_REPLAYED + 2)
        try:
            sock.connect(self.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            received = added = 0
            while True:
                try:
                    frames = await sock.recv_multipart(zmq.NOBLOCK)  # b"", topic, seq, payload
                except zmq.Again:  # none queued: wait for one (the first under the timeout only)
                    if not await sock.poll(REPLAY_QUIET_S * 1000 if received else None):
                        return added
                    continue
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return added
                received += 1
                seq = batch_number(frames[2])
                if start <= seq < until and seq not in batches:
                    batches[seq] = frames[1:]
                    added += len(frames[3])
                    if len(batches) > MAX_REPLAYED or size + added > MAX_REPLAY_BYTES:
                        raise ReplayTooLarge(f"more than {MAX_REPLAYED} batches or "
                                             f"{MAX_REPLAY_BYTES} bytes")
                if seq >= until - 1:
                    return added
                if received % 64 == 0:  # queued messages come without a wait: let others run
                    await asyncio.sleep(0)
        finally:
            sock.close(linger=0)

    def handle(self, frames: list[bytes]) -> None:
        """One multipart message from the PUB socket: [topic, seq, msgpack batch]. Anything
        malformed is counted and skipped; nothing here raises."""
        if len(frames) != 3:
            self._rejected_batch(f"{len(frames)} frames, expected 3")
            return
        _topic, seq_bytes, payload = frames
        seq = batch_number(seq_bytes)
        if self.last_seq >= 0 and seq != self.last_seq + 1:
            self.sequence_gaps += 1
            if seq <= self.last_seq:
                # The numbering went back: the engine restarted (vLLM numbers a publisher's
                # batches from 0), with an empty cache and no AllBlocksCleared sent. What the
                # index held for it is gone; it learns the engine's blocks again as they are stored.
                self.events.forget_all()
                what = "the engine restarted: its cached blocks forgotten"
            else:
                # Batches missed (the subscription was down, or a queue overflowed): a few blocks
                # they removed may still be counted. Kept: the rest of the cache is still there,
                # and blocks that stay cached are never stored again, so forgetting them would
                # lose the prefixes chained on them until the engine evicts those.
                what = "batches missed"
            self._log_rejection(f"batch {seq} after {self.last_seq}: {what} "
                                f"({self.sequence_gaps} gaps so far)")
        self.last_seq = seq
        if len(payload) > MAX_BATCH_BYTES:
            self._rejected_batch(f"{len(payload)} bytes (at most {MAX_BATCH_BYTES} are decoded)")
            return
        try:
            # the events are counted before any is decoded: a batch of millions of empty
            # arrays cost seconds of the loop and as many rejections
            events = _decode_batch(payload).events
            count = _array_length(events)
            if count is None:
                self._rejected_batch("not an event batch ([ts, [events...], ...])")
                return
            if count > MAX_BATCH_EVENTS:
                self._rejected_batch(f"{count} events (no engine step sends over "
                                     f"{MAX_BATCH_EVENTS})")
                return
            events = msgspec.msgpack.decode(events)
        except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: deep nesting
            self._rejected_batch(f"undecodable: {exc}")
            return
        rejected = None
        for event in events:
            try:
                self.events.apply(event)
                self.events_applied += 1
            except EventRejected as exc:
                self.events_rejected += 1
                rejected = exc
        if rejected is not None:
            self._log_rejection(f"skipped malformed events (last: {rejected})")

    def _rejected_batch(self, why: str) -> None:
        self.batches_rejected += 1
        self._log_rejection(f"skipped a KV event batch: {why}")

    def _log_rejection(self, message: str, exc_info: bool = False) -> None:
        now = time.monotonic()  # a hostile or broken publisher must not flood the log
        if now - self._last_reject_log >= REJECT_LOG_INTERVAL_S:
            self._last_reject_log = now
            log.warning("KV events of %s: %s (%d batches, %d events rejected so far)",
                        self.worker_url, message, self.batches_rejected, self.events_rejected,
                        exc_info=exc_info)


class _Batch(msgspec.Struct, array_like=True):
    """vLLM's EventBatch, [ts, events, data_parallel_rank?]: its events still undecoded."""

    ts: msgspec.Raw
    events: msgspec.Raw


_decode_batch = msgspec.msgpack.Decoder(_Batch).decode


def _array_length(raw: msgspec.Raw) -> int | None:
    """How many items the msgpack array `raw` holds, from its header (None: not an array)."""
    data = memoryview(raw)
    if 0x90 <= data[0] <= 0x9F:
        return data[0] & 0x0F
    if data[0] in (0xDC, 0xDD):
        return int.from_bytes(data[1:3 if data[0] == 0xDC else 5], "big")
    return None
