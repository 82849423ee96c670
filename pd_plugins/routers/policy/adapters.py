"""LoRA adapters: a request that names an adapter goes only to the workers that serve it.

Applied by the scheduler before every profile's own filters (policy/scheduler.py), whatever the
policy: a worker without the adapter would answer 404, or, worse, a prefill leg there could never
produce KV for it. Workers report their adapters in /v1/models (vLLM lists each one with the base
model as `parent`; health.py keeps them in `Worker.adapter_parents`). A request for the base model
(`RequestInfo.adapter` None) passes untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd_plugins.routers.policy.base import RequestInfo

if TYPE_CHECKING:
    from pd_plugins.routers.workers import Worker


def serving_adapter(request: RequestInfo, workers: list[Worker]) -> list[Worker]:
    """The workers that can serve the request's adapter (all of them for the base model)."""
    if request.adapter is None:
        return workers
    return [w for w in workers if request.adapter in w.adapter_parents]
