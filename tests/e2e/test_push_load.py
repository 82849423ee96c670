"""Push mode under load (issue 10): 120 requests on a CPU-starved 2-core machine, none hung.

Upstream NIXL push left about one request in twenty waiting forever on such a machine (the
registration or the WRITE never came and nothing timed out). PdNixlConnector gives every push a
deadline on the decode (`push_timeout_s`): a push that misses it is a failed load, recomputed here
(kv_load_failure_policy=recompute), so every request ends, and its output is still right.
Half the requests send the prefill leg first, the order that used to starve the handshake.

What still fails upstream under this load, and becomes a bounded recompute here: a prefill-to-decode
handshake whose side-channel reply misses upstream's 5 s (never retried: that request's WRITE is
lost), WRITEs posted that never complete on either side, and decode legs that reach the decode's
scheduler many seconds late, after the prefill's lease ran out. The counts are printed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from pd_plugins.testing.engine_harness import metric_value
from pd_plugins.testing.pd_client import pd_push
from tests.e2e.deployments import CONCURRENT, PROMPTS, PdConfig, completion_body

pytestmark = pytest.mark.e2e

REQUESTS = 120  # upstream hung about one in twenty: six expected
CONCURRENCY = 4
MAX_TOKENS = 8
# Short, so that the pushes that do fail (about a quarter here: see the closing paragraph) fail fast.
LEASE_SECONDS = 6
PUSH_TIMEOUT_S = 12.0
# A request not answered by then is hung: its push deadline, then a recompute, with room to spare.
HUNG_AFTER_S = PUSH_TIMEOUT_S + 60.0
PUSH_LOAD = PdConfig("tiny-llama", "push", prefix_caching=True, failure_policy="recompute",
                     lease_seconds=LEASE_SECONDS,
                     extra=(("push_timeout_s", PUSH_TIMEOUT_S),))
PROMPT_SET = [*CONCURRENT, PROMPTS[64], PROMPTS[100], PROMPTS[150]]


class CpuHogs:
    """Busy processes on both cores, started and stopped by PID."""

    def __init__(self, count: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(count)]

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def test_push_under_cpu_contention_has_no_hung_requests(pool, references):
    pd = pool.get(PUSH_LOAD)
    expected = references["tiny-llama"]

    def one(i: int):
        prompt = PROMPT_SET[i % len(PROMPT_SET)]
        body = completion_body(prompt, max_tokens=MAX_TOKENS)
        started = time.monotonic()
        try:
            _, resp = pd_push(pd.target, pd.decode.url, body, timeout=HUNG_AFTER_S,
                              registration_head_start=0.1, prefill_first=bool(i % 2))
        except requests.Timeout:
            return i, "hung", time.monotonic() - started
        if resp.status_code != 200:
            return i, f"HTTP {resp.status_code}", time.monotonic() - started
        ids = resp.json()["choices"][0]["token_ids"]
        ok = ids == expected[tuple(prompt)][:MAX_TOKENS]
        return i, "ok" if ok else "wrong output", time.monotonic() - started

    hogs = CpuHogs(count=1)
    try:
        with ThreadPoolExecutor(CONCURRENCY) as workers:
            outcomes = list(workers.map(one, range(REQUESTS)))
    finally:
        hogs.stop()
    by_kind: dict[str, int] = {}
    for _, kind, _ in outcomes:
        by_kind[kind] = by_kind.get(kind, 0) + 1
    decode, prefill = pd.decode.metrics(), pd.prefill.metrics()
    for order, parity in (("decode first", 0), ("prefill first", 1)):
        seconds = sorted(s for i, _, s in outcomes if i % 2 == parity)
        print(f"push load, {order}: median {seconds[len(seconds) // 2]:.2f} s, "
              f"slowest {seconds[-1]:.1f} s")
    print(f"push load: {by_kind}; decode: push timeouts "
          f"{metric_value(decode, 'vllm:pd_nixl_push_timeouts_total'):.0f}, recomputes "
          f"{metric_value(decode, 'vllm:pd_nixl_recomputes_total'):.0f}; prefill: expired leases "
          f"{metric_value(prefill, 'vllm:nixl_num_kv_expired_reqs_total'):.0f}, refused writes "
          f"{metric_value(prefill, 'vllm:pd_nixl_refused_writes_total'):.0f}, held sends "
          f"{metric_value(prefill, 'vllm:pd_nixl_held_sends_total'):.0f}")
    assert by_kind.get("hung", 0) == 0, by_kind
    assert by_kind == {"ok": REQUESTS}, by_kind  # failed pushes were recomputed, outputs right
