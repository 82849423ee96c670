"""What the mock counts and keeps for its clients: `/mock/stats`, `/mock/bodies`, `/mock/timings`."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pd_plugins.mock.protocol import LegTiming

BODIES_KEPT = 64
TIMINGS_KEPT = 100_000
"""Legs /mock/timings remembers (the oldest go first): a replay's worth, in bounded memory."""

COUNTERS = ("requests", "prefill_legs", "remote_decodes", "local", "mismatched_kv",
            "failed_injected", "canaries", "cancelled")


@dataclass
class MockStats:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    running: int = 0     # requests being handled
    streaming: int = 0   # streams that have sent at least one token
    # the last request bodies received: what the router forwarded
    bodies: deque = field(default_factory=lambda: deque(maxlen=BODIES_KEPT))
    timings: deque[LegTiming] = field(default_factory=lambda: deque(maxlen=TIMINGS_KEPT))

    def count(self, counter: str) -> None:
        self.counts[counter] += 1

    def snapshot(self, rooms_held: int, model: dict[str, Any]) -> dict[str, Any]:
        """/mock/stats: the counters, the KV rooms still held, and the timing's own (`model`)."""
        return {**self.counts, "rooms_held": rooms_held, "running": self.running,
                "streaming": self.streaming, **model}
