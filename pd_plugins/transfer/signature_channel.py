"""Worker -> scheduler side channel for per-request results a worker computes during the forward
pass and the scheduler needs when the request finishes (expert signatures, ELDR).

vLLM's own route (worker metadata in the step's output) reaches the scheduler's connector only
after it has finished the request and returned its kv_transfer_params, so it comes too late. The
worker pushes each step's results over ZMQ (ipc, a path derived from the engine id, so workers can
connect before the scheduler binds) right after the forward pass, before the step's output leaves
the worker; the scheduler drains them when a request finishes, waiting briefly if needed.

The ipc sockets live in this user's private directory (transfer/private_dir.py, mode 0700), so
no other local user can bind the path first, connect to it, or read what passes; a message is at
most MAX_MESSAGE_BYTES and a queue at most HWM messages.

Engine-agnostic: pyzmq and msgspec only.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from typing import Any

import msgspec
import zmq

from pd_plugins.transfer.private_dir import private_dir

MAX_HELD = 10_000     # results kept for requests the scheduler has not finished yet
WAIT_S = 0.05         # how long the scheduler waits for a result still in flight
MAX_MESSAGE_BYTES = 16 * 2**20  # one step's results (a peer's bigger message is dropped)
HWM = 1000            # messages queued per socket


def channel_address(engine_id: str, purpose: str = "experts") -> str:
    """An ipc address in this user's private directory (the same for every process of the
    engine: the path derives from the engine id)."""
    digest = hashlib.sha1(f"{purpose}:{engine_id}".encode()).hexdigest()[:16]
    return f"ipc://{os.path.join(private_dir(), f'pd-{purpose}-{digest}.sock')}"


def bounded_socket(kind: int, max_message_bytes: int = MAX_MESSAGE_BYTES) -> zmq.Socket:
    """A ZMQ socket with no linger, bounded queues and a bounded message size."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    return sock


class ResultSender:
    """Worker side: push {request id: result} once per step (never blocks the forward pass)."""

    def __init__(self, address: str) -> None:
        self._sock = bounded_socket(zmq.PUSH)
        self._sock.connect(address)
        self.dropped = 0

    def send(self, results: dict[str, Any]) -> None:
        if not results:
            return
        try:
            self._sock.send(msgspec.msgpack.encode(results), zmq.NOBLOCK)
        except zmq.Again:  # the scheduler is not reading: the router routes without them
            self.dropped += len(results)

    def close(self) -> None:
        self._sock.close(linger=0)


class ResultReceiver:
    """Scheduler side: results by request id, bounded (oldest dropped first)."""

    def __init__(self, address: str) -> None:
        self._sock = bounded_socket(zmq.PULL)
        self._sock.bind(address)
        self._held: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._decoder = msgspec.msgpack.Decoder(dict)

    def _drain(self, wait_ms: int = 0) -> None:
        while self._sock.poll(wait_ms):
            try:
                batch = self._decoder.decode(self._sock.recv(zmq.NOBLOCK))
            except (zmq.Again, msgspec.DecodeError):
                return
            for req_id, result in batch.items():
                self._held[str(req_id)] = result
                while len(self._held) > MAX_HELD:
                    self._held.popitem(last=False)
            wait_ms = 0

    def take(self, req_id: str, wait_s: float = WAIT_S, missing: Any = None) -> Any:
        """The result for `req_id` (removed), waiting up to `wait_s` for it; `missing` if none
        came (a result may itself be None)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                self._drain()
                if req_id in self._held:
                    return self._held.pop(req_id)
                left = deadline - time.monotonic()
                if left <= 0:
                    return missing
                self._drain(max(1, int(left * 1000)))

    def close(self) -> None:
        self._sock.close(linger=0)
