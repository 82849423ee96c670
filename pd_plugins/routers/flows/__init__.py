"""Engine PD flows: what the router sends to the prefill and decode workers of each engine.

A flow's `prepare` runs whatever must come before the decode leg and returns the decode body plus
the prefill leg if it still runs alongside (vLLM push, SGLang). The proxy then opens the decode leg
and relays its answer. Each engine's module also registers its profile (profile.py): its flows,
load metrics, health canary, whether its decode can prefill, and the worker options it needs.
"""

from pd_plugins.routers.flows import sglang, vllm
from pd_plugins.routers.flows.base import Attempt, PdFlow, PrefillLeg
from pd_plugins.routers.flows.profile import EngineProfile

PROFILES: dict[str, EngineProfile] = {p.name: p for p in (vllm.PROFILE, sglang.PROFILE)}


def profile_for(engine: str) -> EngineProfile:
    return PROFILES[engine]


__all__ = ["Attempt", "EngineProfile", "PdFlow", "PrefillLeg", "PROFILES", "profile_for"]
