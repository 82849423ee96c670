"""Prometheus metrics of the router (its own registry, served on /metrics)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
        self.requests = Counter("pd_router_requests", "Requests by PD decision and outcome",
                                ["decision", "outcome"], registry=r)
        self.ttft = Histogram("pd_router_ttft_seconds", "Router-measured time to first token "
                              "(streaming requests)", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pd_router_tpot_seconds", "Router-measured time per output token "
                              "(streaming requests)", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pd_router_e2e_seconds", "Request latency, arrival to last byte",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.leg = Histogram("pd_router_leg_seconds", "Latency of each leg", ["leg"],
                             buckets=LATENCY_BUCKETS, registry=r)
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
        self.loop_lag = Histogram("pd_router_event_loop_lag_seconds", "How late the event loop "
                                  f"runs a timer due every {LOOP_LAG_PERIOD_S:g} s",
                                  buckets=LOOP_LAG_BUCKETS, registry=r)
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

        def tick(due: float) -> None:
            now = loop.time()
            self.loop_lag.observe(max(0.0, now - due))
            holder[0] = loop.call_at(now + LOOP_LAG_PERIOD_S, tick, now + LOOP_LAG_PERIOD_S)

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

