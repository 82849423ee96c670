"""Worker -> scheduler side channel for per-request results a worker computes during the forward
pass and the scheduler needs when the request finishes (expert signatures, ELDR).

vLLM's own route (worker metadata in the step's output) reaches the scheduler's connector only
after it has finished the request and returned its kv_transfer_params, so it comes too late. The
worker pushes each step's results over ZMQ (ipc, a path derived from the engine id, so workers can
connect before the scheduler binds) right after the forward pass, before the step's output leaves
the worker; the scheduler drains them when a request finishes, waiting briefly if needed.

Engine-agnostic: pyzmq and msgspec only.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
import time
from collections import OrderedDict
from typing import Any

import msgspec
import zmq

MAX_HELD = 10_000     # results kept for requests the scheduler has not finished yet
WAIT_S = 0.05         # how long the scheduler waits for a result still in flight


def channel_address(engine_id: str, purpose: str = "experts") -> str:
    digest = hashlib.sha1(f"{purpose}:{engine_id}".encode()).hexdigest()[:16]
    return f"ipc://{tempfile.gettempdir()}/pd-{purpose}-{digest}.sock"


class ResultSender:
    """Worker side: push {request id: result} once per step (never blocks the forward pass)."""

    def __init__(self, address: str) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 1000)
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
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
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

    def take(self, req_id: str, wait_s: float = WAIT_S) -> Any | None:
        """The result for `req_id` (removed), waiting up to `wait_s` for it; None if none came."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                self._drain()
                if req_id in self._held:
                    return self._held.pop(req_id)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._drain(max(1, int(left * 1000)))

    def close(self) -> None:
        self._sock.close(linger=0)
