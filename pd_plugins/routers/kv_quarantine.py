"""Rotation on KV mismatches (issue 28, docs/plans/kv-verification.md §5): a decode whose
`vllm:pd_kv_mismatched_requests_total` (streams included) rose by `failures` or more within
`window_s` is taken out of rotation for `quarantine_s`; good health probes do not bring it back
earlier (a canary is a plain generation and passes). Never the last usable worker of its role and
model: a verified load is recomputed, so answers stay right; quarantine is about cost and hygiene,
and taking every decode out would be an outage.

The counter names no peer, so a bad prefill shows up as mismatches at every decode. The
non-streamed answers' verdicts name both workers: a prefill whose KV mismatched at 2 or more
different decodes within `window_s` is the one at fault and goes out the same way (never the last
usable prefill either), and the rises of those decodes' counters so far are forgotten (a scrape
after that can still bring in a rise from its KV: scrapes lag by up to `metrics_interval_s`).
Not built: a decode blamed from its verdicts by its prefills, and the "only one peer, `failures`
in a row" rule of the plan (the counter rule covers a lone decode).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily

from pd_plugins.routers.config import KvVerifySpec
from pd_plugins.routers.workers import Worker

log = logging.getLogger("pd_router.kv_quarantine")

MAX_EVENTS = 1024  # rises kept per worker (a window's worth; older ones fall out first)
MAX_WORKERS = 4096  # workers tracked (discovery churns them): the longest unseen are forgotten


class KvQuarantine:
    """`clock`: monotonic seconds, the same one `Worker.quarantined_until` is compared with."""

    def __init__(self, spec: KvVerifySpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec, self.clock = spec, clock
        # worker ordinal -> (counter value, when) at its last scrape
        self._last: dict[int, tuple[float, float]] = {}
        self._rises: dict[int, deque[tuple[float, float]]] = {}  # ordinal -> (when, by how much)
        self._spared: set[int] = set()  # over the limit but the last of its role (logged once)
        # quarantined_decode, quarantined_prefill, spared (the last usable of its role)
        self.counts = {"quarantined_decode": 0, "quarantined_prefill": 0, "spared": 0}
        # prefill ordinal -> (when, decode ordinal) of mismatched loads its KV caused
        self._blamed: dict[int, deque[tuple[float, int]]] = {}

    def observe(self, worker: Worker, value: float, pool: Iterable[Worker]) -> bool:
        """One scrape's counter value of `worker`; True when this took it out of rotation."""
        if worker.role != "decode":
            return False
        now = self.clock()
        seen = self._last.pop(worker.ordinal, None)
        self._last[worker.ordinal] = (value, now)  # last in order: the most recently seen
        if len(self._last) > MAX_WORKERS:
            gone = next(iter(self._last))
            for table in (self._last, self._rises, self._blamed):
                table.pop(gone, None)
        # the first look, or the first after a gap (down, quarantined) longer than the window:
        # a baseline; mismatches of unknown time are not counted
        if seen is None or seen[1] < now - self.spec.window_s:
            return False
        last = seen[0]
        rise = value - last if value >= last else value  # fell: the engine restarted
        rises = self._rises.setdefault(worker.ordinal, deque(maxlen=MAX_EVENTS))
        if rise > 0:
            rises.append((now, rise))
        while rises and rises[0][0] < now - self.spec.window_s:
            rises.popleft()
        if sum(r for _, r in rises) < self.spec.failures:
            self._spared.discard(worker.ordinal)
            return False
        why = f"{int(sum(r for _, r in rises))} KV mismatches within {self.spec.window_s:g} s"
        if not self._take_out(worker, pool, now, why):
            return False
        rises.clear()
        return True

    def verdict(self, prefill: Worker | None, decode: Worker, mismatched: int,
                pool: Iterable[Worker]) -> bool:
        """A non-streamed answer's verdict (`mismatched` blocks); True when this took the
        prefill out of rotation."""
        if prefill is None or mismatched <= 0:
            return False
        now = self.clock()
        blamed = self._blamed.pop(prefill.ordinal, None) or deque(maxlen=MAX_EVENTS)
        self._blamed[prefill.ordinal] = blamed  # last in order: the most recently blamed
        if len(self._blamed) > MAX_WORKERS:
            self._blamed.pop(next(iter(self._blamed)))
        blamed.append((now, decode.ordinal))
        while blamed and blamed[0][0] < now - self.spec.window_s:
            blamed.popleft()
        decodes = {d for _, d in blamed}
        if len(decodes) < 2:
            return False
        why = f"its KV mismatched at {len(decodes)} decodes within {self.spec.window_s:g} s"
        if not self._take_out(prefill, pool, now, why):
            return False
        blamed.clear()
        for d in decodes:  # their counters' rises so far were this prefill's doing
            self._rises.pop(d, None)
        return True

    def _take_out(self, worker: Worker, pool: Iterable[Worker], now: float, why: str) -> bool:
        others = [w for w in pool if w is not worker and w.role == worker.role
                  and w.model == worker.model and w.usable]
        if not others:
            if worker.ordinal not in self._spared:
                self._spared.add(worker.ordinal)
                self.counts["spared"] += 1
                log.warning("%s %s: %s, but it is the last usable %s: kept in rotation",
                            worker.role, worker.url, why, worker.role)
            return False
        self._spared.discard(worker.ordinal)
        worker.healthy = False
        worker.consecutive_successes = 0
        worker.quarantined_until = now + self.spec.quarantine_s
        self.counts[f"quarantined_{worker.role}"] += 1
        log.warning("%s %s out of rotation for %g s: %s", worker.role, worker.url,
                    self.spec.quarantine_s, why)
        return True

    def quarantined(self, worker: Worker) -> bool:
        return worker.quarantined_until > self.clock()

    def collector(self) -> "QuarantineCollector":
        return QuarantineCollector(self)


class QuarantineCollector:
    """/metrics: `pd_router_kv_quarantine_events_total{event}`."""

    def __init__(self, quarantine: KvQuarantine) -> None:
        self.quarantine = quarantine

    def collect(self):
        events = CounterMetricFamily("pd_router_kv_quarantine_events", "Workers taken out of "
                                     "rotation for KV mismatches, by role, and times the last "
                                     "usable worker of a role was spared", labels=["event"])
        for event, count in self.quarantine.counts.items():
            events.add_metric([event], count)
        yield events
