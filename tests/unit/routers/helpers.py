"""Small builders for policy unit tests: a pool of workers with chosen state."""

from __future__ import annotations

from pd_plugins.routers.config import LatencySpec, WorkerSpec
from pd_plugins.routers.policy.base import PolicyContext, RequestInfo
from pd_plugins.routers.policy.latency_model import LatencyModels
from pd_plugins.routers.policy.prefix_index import PrefixIndex, block_keys
from pd_plugins.routers.workers import WorkerPool

BLOCK = 4


def context(prefills: int = 2, decodes: int = 2, **latency) -> PolicyContext:
    pool = WorkerPool()
    for i in range(prefills):
        pool.add(WorkerSpec(url=f"http://127.0.0.1:{8100 + i}"), "prefill")
    for i in range(decodes):
        pool.add(WorkerSpec(url=f"http://127.0.0.1:{8200 + i}"), "decode")
    return PolicyContext(pool, PrefixIndex(), LatencyModels(LatencySpec(**latency)), BLOCK)


def request(tokens: list[int], **kw) -> RequestInfo:
    return RequestInfo(prompt_tokens=len(tokens), block_keys=block_keys(tokens, BLOCK), **kw)
