"""A decode's event stream on its way to the client, relayed in the leg's connection callback.

The proxy hands an `SseRelay` to the decode leg's Response.pipe (http_client.py): each piece of
the stream is written to the client as it arrives, in the connection's own callback, so that a
streamed answer wakes the request's task only at its end, not once per token
(docs/benchmarks.md, "Streaming token by token": a wake-up per token had made a token's relay
cost about 3 times vllm-router's user CPU). The relay hands the writing back to that task (True
from the sink: a pause) when it cannot write now: the client's socket is full, the client is
gone, or the answer is aiohttp's (its writes are coroutines). The task then writes what waits
(`pending`) under the client write timeout and resumes the leg.

Whole events only go to the client: the rest of a piece (TCP cuts anywhere) waits for its end,
so that an error event after a broken leg starts an event of its own. The piece that ends the
stream goes out with the answer's end (the chunked body's last chunk) in one write: a write to
the client is a system call, and a short answer that arrives whole is then written once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pd_plugins.routers.http_server import FastStreamResponse

log = logging.getLogger("pd_router.proxy")
MAX_HELD_EVENT = 1 << 20  # the unfinished end of a streamed piece held for the rest of its event


class SseRelay:
    """The sink of a piped decode leg (see the module's docstring)."""

    __slots__ = ("out", "measured", "source", "fast", "events", "first_at", "last_at", "tail",
                 "pending", "held", "gone")

    def __init__(self, out: Any, measured: Any, source: Any = None) -> None:
        self.out, self.measured = out, measured
        # the decode leg's Response: a piece that ends it (done) goes out with the answer's end,
        # in one write
        self.source = source
        self.fast = isinstance(out, FastStreamResponse)  # written here; aiohttp's by the task
        self.events = 0  # whole `data:` events relayed: the tokens, and [DONE]
        self.first_at = self.last_at = time.monotonic()
        self.tail = b""  # an event's beginning, waiting for its end
        self.pending: list[bytes] = []  # whole events the task writes (held)
        self.held = not self.fast  # the task writes: pieces wait in pending
        self.gone = False  # the client's connection closed under a write

    def __call__(self, piece: bytes) -> bool:
        """Relay one piece of the stream; True: the task has to write (reading pauses)."""
        self.last_at = time.monotonic()
        if self.tail or not piece.endswith((b"\n\n", b"\r\n\r\n")):  # (nearly always ends one)
            piece, self.tail = whole_events(self.tail + piece)
            if not piece:
                return False
        self.events += piece.count(b"data:")  # counted whole: a piece may cut one in two
        if self.measured is not None:  # its tokens so far: /admin/in_flight
            self.measured.streamed = self.events
        if self.held:
            self.pending.append(piece)
            return True
        try:
            # True: the client's socket is full
            self.held = self.out.send(piece, self.source is not None and self.source.done
                                      and not self.tail)
        except ConnectionResetError:
            self.held = self.gone = True
        except Exception:  # noqa: BLE001 - raised here, it would be blamed on the decode worker
            log.exception("relaying a stream to its client failed; the client is dropped")
            self.held = self.gone = True
        return self.held


def whole_events(data: bytes) -> tuple[bytes, bytes]:
    """(the complete SSE events in `data`, the unfinished rest). An event ends at a blank line
    (\\n\\n, or \\r\\n\\r\\n). A rest past MAX_HELD_EVENT is let through whole: what is held
    per stream stays bounded."""
    if data.endswith((b"\n\n", b"\r\n\r\n")):
        return data, b""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\n\r\n")
    end = max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)
    if len(data) - end > MAX_HELD_EVENT:
        return data, b""
    return data[:end], data[end:]
