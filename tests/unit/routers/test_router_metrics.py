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
