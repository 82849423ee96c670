"""Engine PD flows: what the router sends to the prefill and decode workers of each engine.

A flow's `prepare` runs whatever must come before the decode leg and returns the decode body plus
the prefill leg if it still runs alongside (vLLM push, SGLang). The proxy then opens the decode leg
and relays its answer.
"""

from pd_plugins.routers.flows.base import Attempt, PdFlow, PrefillLeg
from pd_plugins.routers.flows.sglang import SglangFlow
from pd_plugins.routers.flows.vllm import VllmPullFlow, VllmPushFlow


def flow_for(engine: str, transfer: str, push_head_start_s: float = 0.1) -> PdFlow:
    if engine == "sglang":
        return SglangFlow()
    # the pools (PdShmConnector, PdLMCacheConnector) have the pull flow's two steps: prefill,
    # then decode with its params
    return VllmPushFlow(push_head_start_s) if transfer == "push" else VllmPullFlow()


__all__ = ["Attempt", "PdFlow", "PrefillLeg", "flow_for"]
