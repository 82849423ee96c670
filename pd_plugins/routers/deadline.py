"""A timeout that moves on every request and almost never fires, for the router's hot path.

Why: a connection's timeout is re-armed for every request (the front server's read and keep-alive
timeouts, each leg's timeout), and `loop.call_later` plus `cancel` per arm was a measurable part of
pd-router's CPU per request (docs/benchmarks.md, "Router hot path profile"). Here `arm()` only moves
a due time; the one pending TimerHandle stays where it is as long as it is not later than the new
due time, and when it fires early it re-schedules itself to the due time then current. A
connection serving requests back to back therefore schedules about one timer per timeout period,
not two per request. `disarm()` is a store; `cancel()` drops the pending handle (a closed
connection).
"""

from __future__ import annotations

import asyncio
from typing import Callable

# A handle may fire up to a clock tick early (libuv counts in milliseconds): within this of its
# due time it counts as due, so that it does not re-schedule itself for nothing.
EARLY_S = 0.002


class Deadline:
    __slots__ = ("_loop", "_fire", "_due", "_handle", "_handle_at")

    def __init__(self, loop: asyncio.AbstractEventLoop, fire: Callable[[], None]) -> None:
        self._loop, self._fire = loop, fire
        self._due: float | None = None  # None: disarmed
        self._handle: asyncio.TimerHandle | None = None
        self._handle_at = 0.0

    @property
    def armed(self) -> bool:
        return self._due is not None

    def arm(self, seconds: float) -> None:
        """Call `fire` unless disarm()/arm() comes within `seconds` from now."""
        due = self._loop.time() + seconds
        self._due = due
        if self._handle is not None:
            if self._handle_at <= due:
                return  # fires first, then moves itself to `due`
            self._handle.cancel()
        self._handle_at = due
        self._handle = self._loop.call_at(due, self._expire)

    def disarm(self) -> None:
        self._due = None

    def cancel(self) -> None:
        """Disarm and drop the pending handle (the owner is closing)."""
        self._due = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _expire(self) -> None:
        self._handle = None
        due = self._due
        if due is None:
            return
        if self._loop.time() < due - EARLY_S:  # re-armed since: wait for the due time now
            self._handle_at = due
            self._handle = self._loop.call_at(due, self._expire)
            return
        self._due = None
        self._fire()
