"""Routing policies: small named pieces (filters, scorers, pickers, deciders, admission).

Importing this package registers every built-in piece; `scheduler.preset(name)` gives the
`--policy` shorthands.
"""

from pd_plugins.routers.policy import (  # noqa: F401  (registration side effects)
    conversation, deciders, expert_locality, filters, kv_cost, load, peers, pickers, prefix, ttft,
)
from pd_plugins.routers.policy.base import Decision, PolicyContext, Rejection, RequestInfo
from pd_plugins.routers.policy.scheduler import DEFAULT_POLICY, PRESETS, Scheduler, preset

__all__ = ["Decision", "PolicyContext", "Rejection", "RequestInfo", "Scheduler", "preset",
           "PRESETS", "DEFAULT_POLICY"]
