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
