"""The router's own metrics that are not per request (metrics.py)."""

import asyncio
import time

from pd_plugins.routers.metrics import RouterMetrics


def test_the_loop_lag_probe_sees_a_blocked_loop():
    async def main():
        metrics = RouterMetrics([])
        handle = metrics.watch_loop()
        await asyncio.sleep(0.15)
        time.sleep(0.3)  # a stall: the timer due meanwhile runs late
        await asyncio.sleep(0.25)
        handle.cancel()
        text = metrics.exposition().decode()
        assert 'pd_router_event_loop_lag_seconds_bucket{le="0.1"}' in text
        late = [line for line in text.splitlines()
                if line.startswith('pd_router_event_loop_lag_seconds_bucket{le="0.1"}')][0]
        total = [line for line in text.splitlines()
                 if line.startswith("pd_router_event_loop_lag_seconds_count")][0]
        assert float(late.split()[-1]) < float(total.split()[-1])  # one tick was > 0.1 s late
    asyncio.run(main())


def test_loop_series_export_as_prometheus_histograms_and_counters():
    from prometheus_client.parser import text_string_to_metric_families

    metrics = RouterMetrics([])
    for value in (0.004, 0.005, 0.3, 200.0):  # on a bound counts in it (le is inclusive)
        metrics.e2e.observe(value)
    metrics.leg.labels("prefill").observe(0.02)
    metrics.requests.labels("disaggregated", "ok").inc()
    metrics.requests.labels("disaggregated", "ok").inc()
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    e2e = {(s.name, s.labels.get("le")): s.value for s in families["pd_router_e2e_seconds"].samples}
    assert e2e[("pd_router_e2e_seconds_bucket", "0.005")] == 2
    assert e2e[("pd_router_e2e_seconds_bucket", "0.5")] == 3
    assert e2e[("pd_router_e2e_seconds_bucket", "120.0")] == 3
    assert e2e[("pd_router_e2e_seconds_bucket", "+Inf")] == 4
    assert e2e[("pd_router_e2e_seconds_count", None)] == 4
    assert abs(e2e[("pd_router_e2e_seconds_sum", None)] - 200.309) < 1e-9
    legs = [s for s in families["pd_router_leg_seconds"].samples if s.name.endswith("_count")]
    assert [(s.labels, s.value) for s in legs] == [({"leg": "prefill"}, 1.0), ({"leg": "decode"}, 0.0)]
    requests = families["pd_router_requests"].samples
    assert [(s.name, s.labels, s.value) for s in requests] == [
        ("pd_router_requests_total", {"decision": "disaggregated", "outcome": "ok"}, 2.0)]


def test_observed_values_wait_at_most_a_tick_of_the_loop_watcher():
    # observe() only appends (no Python per value); the watcher folds what waits every tick, so
    # a router nobody scrapes holds a tenth of a second's values, not every value since it began
    async def main():
        metrics = RouterMetrics([])
        handle = metrics.watch_loop()
        decode = metrics.leg.labels("decode")
        for i in range(1000):
            metrics.e2e.observe(0.001 * i)
            decode.observe(0.02)
        assert len(metrics.e2e.labels().pending) == 1000
        await asyncio.sleep(0.25)
        handle.cancel()
        assert metrics.e2e.labels().pending == [] and decode.pending == []
        assert sum(metrics.e2e.labels().counts) == 1000 and decode.counts[2] == 1000  # le=0.025
        assert abs(metrics.e2e.labels().sum - 0.001 * sum(range(1000))) < 1e-6
    asyncio.run(main())
