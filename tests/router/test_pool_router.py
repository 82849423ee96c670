"""pd-router with workers on a shared-memory KV pool (`kv_pool=PATH`) that cannot be read: a
truncated pool file is an unknown pool (no prefix credit), never a 5xx; a good pool made at the
path later is read. The router is a real process in front of pd-mock-engine processes."""

from __future__ import annotations

import os

import requests

from pd_plugins.testing.engine_harness import start_all
from pd_plugins.testing.router_harness import RouterProcess
from pd_plugins.transfer.shm_pool import ShmKVPool, remove_pool
from tests.router.conftest import FAST_HEALTH, mocks


def test_a_truncated_pool_costs_no_request(tmp_path, completion_body):
    path = f"/dev/shm/pd-router-proc-{os.getpid()}-{tmp_path.name}"
    ShmKVPool(path, slot_bytes=64, layout="router-proc", size_bytes=1 << 20).close()
    os.truncate(path, 1 << 19)  # a header that promises more than the file holds
    prefills, decodes = mocks(prefills=1, decodes=1)
    router = RouterProcess(
        "router", prefill=[[*p.worker_arg(), f"kv_pool={path}"] for p in prefills],
        decode=[[*d.worker_arg(), f"kv_pool={path}"] for d in decodes],
        args=("--log-format", "text"), config={"health": FAST_HEALTH})
    try:
        start_all([*prefills, *decodes], timeout=60)
        start_all([router], timeout=60)
        for _ in range(4):
            r = requests.post(f"{router.url}/v1/completions", json=completion_body, timeout=30)
            assert r.status_code == 200, r.text
        remove_pool(path)
        with ShmKVPool(path, slot_bytes=64, layout="router-proc", size_bytes=1 << 20):
            for _ in range(2):
                r = requests.post(f"{router.url}/v1/completions", json=completion_body, timeout=30)
                assert r.status_code == 200, r.text
        assert "truncated" in router.log_path.read_text()  # the operator is told why
    finally:
        for proc in [router, *prefills, *decodes]:
            proc.stop(grace=5)
        remove_pool(path)
