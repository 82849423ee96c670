"""Prometheus metrics of the router (its own registry, served on /metrics)."""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections import Counter as _Tally
from functools import partial

from prometheus_client import (CollectorRegistry, Counter, Gauge, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pd_plugins.routers import native

disable_created_metrics()  # no *_created series: they double the scrape for nothing
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
LOOP_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
LOOP_LAG_PERIOD_S = 0.1
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class RouterMetrics:
    """`pool`: every worker (iterated at each scrape); `sessions`: a session table, or a list of
    them (one per model); `by_model`: worker gauges carry a `model` label (several models)."""

    def __init__(self, pool, sessions=None, by_model: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Updated on every request: loop-local series (no lock per update, summed at scrape).
        self.requests = LoopCounter(r, "pd_router_requests", "Requests by PD decision and outcome",
                                    ["decision", "outcome"])
        self.ttft = LoopHistogram(r, "pd_router_ttft_seconds", "Router-measured time to first "
                                  "token (streaming requests)", LATENCY_BUCKETS)
        self.tpot = LoopHistogram(r, "pd_router_tpot_seconds", "Router-measured time per output "
                                  "token (streaming requests)", TPOT_BUCKETS)
        self.e2e = LoopHistogram(r, "pd_router_e2e_seconds", "Request latency, arrival to last byte",
                                 LATENCY_BUCKETS)
        self.leg = LoopHistogram(r, "pd_router_leg_seconds", "Latency of each leg", LATENCY_BUCKETS,
                                 ["leg"])
        self.retries = Counter("pd_router_retries", "Legs retried on another worker", ["leg"], registry=r)
        self.rejections = Counter("pd_router_rejections", "Requests rejected before routing",
                                  ["reason"], registry=r)
        # Not worker failures: the client closed the connection, or read too slowly.
        self.client_gone = Counter("pd_router_client_gone", "Requests whose client went away, by "
                                   "what the router was doing then (prefill, decode, answer) and "
                                   "how (disconnect, write_timeout)", ["stage", "how"], registry=r)
        # a decode's `pd.kv` (non-streamed answers): verified | recomputed | failed | unverified,
        # or other (malformed); streams carry none (docs/plans/kv-verification.md §5)
        self.kv_verdicts = Counter("pd_router_kv_verdicts", "Verdicts decodes gave on the KV they "
                                   "loaded (non-streamed answers)", ["verdict"], registry=r)
        # how late a 100 ms timer fires: the event loop's stalls (GC, a slow callback, saturation)
        self.loop_lag = LoopHistogram(r, "pd_router_event_loop_lag_seconds", "How late the event "
                                      f"loop runs a timer due every {LOOP_LAG_PERIOD_S:g} s",
                                      LOOP_LAG_BUCKETS)
        Gauge("pd_router_native_hot_path", "1 if the router's hot path runs compiled "
              "(routers/native.py: the startup log says why not), else 0",
              registry=r).set(native.native())
        self.prefill_leg = self.leg.labels("prefill")
        self.decode_leg = self.leg.labels("decode")
        r.register(_PoolCollector(pool, by_model))
        tables = [t for t in (sessions if isinstance(sessions, list) else [sessions]) if t is not None]
        if tables:
            r.register(_SessionCollector(tables))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def watch_loop(self) -> _ChainHandle:
        """Observe the loop's lag from now on (a timer chain: no task); cancel the handle to stop."""
        loop = asyncio.get_running_loop()
        holder: list[asyncio.TimerHandle] = []

        histograms = [m for m in vars(self).values() if isinstance(m, LoopHistogram)]

        def tick(due: float) -> None:
            now = loop.time()
            self.loop_lag.observe(max(0.0, now - due))
            holder[0] = loop.call_at(now + LOOP_LAG_PERIOD_S, tick, now + LOOP_LAG_PERIOD_S)
            for histogram in histograms:  # what requests observed since the last tick
                histogram.fold()

        start = loop.time() + LOOP_LAG_PERIOD_S
        holder.append(loop.call_at(start, tick, start))
        return _ChainHandle(holder)


class _PoolCollector:
    """Per-worker gauges, read from the pool at scrape time (nothing to update per request)."""

    def __init__(self, pool, by_model: bool = False) -> None:
        self.pool, self.by_model = pool, by_model

    def collect(self):
        labels = ["role", "url", "model"] if self.by_model else ["role", "url"]
        in_flight = GaugeMetricFamily("pd_router_worker_in_flight", "Requests in flight per worker",
                                      labels=labels)
        healthy = GaugeMetricFamily("pd_router_worker_healthy", "1 if the worker takes requests",
                                    labels=labels)
        for w in self.pool:
            values = [w.role, w.url, w.model] if self.by_model else [w.role, w.url]
            in_flight.add_metric(values, w.in_flight)
            healthy.add_metric(values, 1.0 if w.usable else 0.0)
        yield in_flight
        yield healthy


class _SessionCollector:
    """The session tables' size and their pin counters (routers/sessions.py), summed over the
    models' tables."""

    def __init__(self, tables) -> None:
        self.tables = tables

    def collect(self):
        yield GaugeMetricFamily("pd_router_sessions", "Conversations tracked now",
                                value=sum(len(t) for t in self.tables))
        events = CounterMetricFamily("pd_router_session_events", "Pins, re-pins, expiries, evictions "
                                     "and automatic detections of conversations", labels=["event"])
        totals: dict[str, float] = {}
        for table in self.tables:
            for event, count in table.counts.items():
                totals[event] = totals.get(event, 0) + count
        for event, count in totals.items():
            events.add_metric([event], count)
        yield events


class _ChainHandle:
    """Cancels whichever timer of a chain is pending."""

    def __init__(self, holder: list) -> None:
        self.holder = holder

    def cancel(self) -> None:
        self.holder[0].cancel()


class _LoopSeries:
    """One label set's values; written only from the event loop's thread."""

    __slots__ = ("counts", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets
        self.sum = 0.0


class LoopHistogram:
    """A Prometheus histogram for values observed on the event loop: observe() appends the value
    to a list (a C call, no Python per request), where prometheus_client takes a lock and walks
    every bucket in Python; the values are folded into the buckets at each scrape and by fold(),
    which the router's loop watcher calls every LOOP_LAG_PERIOD_S (so what waits stays a tenth of
    a second's worth). The router observes from its loop only (the scrape runs there too), so
    nothing else writes."""

    def __init__(self, registry: CollectorRegistry, name: str, documentation: str,
                 buckets: tuple[float, ...], labelnames: list[str] | None = None) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.labelnames = list(labelnames or [])
        self.children: dict[tuple[str, ...], LoopHistogram._Child] = {}
        if not self.labelnames:
            self.observe = self.labels().observe  # (no wrapper call per value)
        registry.register(self)

    class _Child(_LoopSeries):
        __slots__ = ("bounds", "pending", "observe")

        def __init__(self, bounds: list[float]) -> None:
            super().__init__(len(bounds) + 1)  # the last: above every bound (+Inf only)
            self.bounds = bounds
            self.pending: list[float] = []  # observed, not yet in the buckets
            self.observe = self.pending.append

        def fold(self) -> None:
            pending, counts = self.pending, self.counts
            if pending:
                values = pending[:]
                pending.clear()  # first, and in place (`observe` is its append): a value that is
                # no number fails this fold alone, and nothing is left to pile up
                # (bucketed and counted in C: a loop per bucket, not per value)
                for bucket, n in _Tally(map(partial(bisect_left, self.bounds), values)).items():
                    counts[bucket] += n
                self.sum += sum(values)

    def labels(self, *values: str) -> LoopHistogram._Child:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
            child = self.children[values] = LoopHistogram._Child(self.bounds)
        return child

    def observe(self, value: float) -> None:
        raise ValueError(f"{self.name}: labels {self.labelnames}: observe through labels()")

    def fold(self) -> None:
        for child in self.children.values():
            child.fold()

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            child.fold()
            running, buckets = 0, []
            for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], child.counts):
                running += count
                buckets.append((bound, running))
            family.add_metric(list(values), buckets, child.sum)
        yield family


class LoopCounter:
    """A Prometheus counter incremented on the event loop (see LoopHistogram: no lock)."""

    def __init__(self, registry: CollectorRegistry, name: str, documentation: str,
                 labelnames: list[str]) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self.children: dict[tuple[str, ...], LoopCounter._Child] = {}
        registry.register(self)

    class _Child:
        __slots__ = ("value",)

        def __init__(self) -> None:
            self.value = 0.0

        def inc(self, amount: float = 1.0) -> None:
            self.value += amount

    def labels(self, *values: str) -> LoopCounter._Child:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
            child = self.children[values] = LoopCounter._Child()
        return child

    def collect(self):
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            family.add_metric(list(values), child.value)
        yield family

