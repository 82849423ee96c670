"""Scheduler -> worker prefix lookups, for KV stores that live inside the worker process.

vLLM runs its scheduler and its workers in different processes (the CPU build too). A store kept
in the worker's memory (LMCache's local CPU and local disk tiers) can only be asked there, so the
worker answers lookups on a ZMQ REP socket (ipc, a path derived from the engine id, in this user's
private directory: no other local user can bind it first or connect) and the scheduler asks with a
deadline: a worker that does not answer in time counts as a miss. A lookup is at most
MAX_LOOKUP_BYTES (a bigger one is dropped by ZMQ: the asker times out).

Engine-agnostic: pyzmq and msgspec only.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

import msgspec
import zmq

from pd_plugins.transfer.signature_channel import bounded_socket, channel_address

log = logging.getLogger("pd_plugins.lookup_channel")
MAX_LOOKUP_BYTES = 64 * 2**20  # a prompt's token ids, msgpack (millions of tokens)


def lookup_address(engine_id: str, rank: int = 0) -> str:
    return channel_address(f"{engine_id}:{rank}", purpose="lookup")


class LookupServer:
    """Worker side: answers `lookup(tokens) -> int` on a background thread."""

    def __init__(self, address: str, lookup: Callable[[Sequence[int]], int]) -> None:
        self._lookup = lookup
        self._sock = bounded_socket(zmq.REP, MAX_LOOKUP_BYTES)
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pd-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(list[int])
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            try:
                tokens = decoder.decode(self._sock.recv())
                answer = int(self._lookup(tokens))
            except Exception as exc:  # a bad request or a failing store: a miss, not a dead thread
                log.warning("lookup failed: %s", exc)
                answer = 0
            self._sock.send(msgspec.msgpack.encode(answer))
        self._sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)


class LookupClient:
    """Scheduler side: one lookup at a time, each within `timeout_s` (0 when late)."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address, self.timeout_ms = address, max(1, int(timeout_s * 1000))
        self._sock: zmq.Socket | None = None
        self.timeouts = 0

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = bounded_socket(zmq.REQ, 1024)  # the answer is one integer
            self._sock.connect(self.address)
        return self._sock

    def lookup(self, tokens: Sequence[int]) -> int:
        sock = self._socket()
        sock.send(msgspec.msgpack.encode(list(tokens)))
        if sock.poll(self.timeout_ms):
            return int(msgspec.msgpack.decode(sock.recv()))
        # a REQ socket waiting for a reply cannot send again: start over with a fresh one
        self.timeouts += 1
        log.warning("worker lookup at %s timed out after %d ms: counted as a miss",
                    self.address, self.timeout_ms)
        sock.close(linger=0)
        self._sock = None
        return 0

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


class RanksLookup:
    """Scheduler side of an engine of several ranks, each holding its part of every chunk (its
    heads): a lookup asks every rank's worker and counts what all of them hold."""

    def __init__(self, addresses: Sequence[str], timeout_s: float) -> None:
        self.clients = [LookupClient(address, timeout_s) for address in addresses]

    def lookup(self, tokens: Sequence[int]) -> int:
        return min(client.lookup(tokens) for client in self.clients)

    def close(self) -> None:
        for client in self.clients:
            client.close()
