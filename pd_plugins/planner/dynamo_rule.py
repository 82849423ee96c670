"""NVIDIA Dynamo's SLA planner sizing rule, re-implemented from its documentation as a baseline.

Sources read: Dynamo's docs "Planner Design", section "Step 4: Replica Calculation"
(ai-dynamo/dynamo docs/pages/design-docs/planner-design.md, read in a fork at commit 6634fc8, v1.x;
published as https://docs.nvidia.com/dynamo/v1.2.0/design-docs/component-design/planner-design.md),
and "Pre-Deployment Profiling" (https://docs.nvidia.com/dynamo/latest/benchmarks/pre_deployment_profiling.html)
for what the profile holds. Per adjustment interval, from the predicted request count, mean ISL
and mean OSL:

    prefill_replicas = ceil(num_req * isl / interval / prefill_throughput_per_gpu)
    decode_replicas  = ceil(num_req * osl / interval / decode_throughput_per_gpu)

- `prefill_throughput_per_gpu` (tokens/s): the profiled prefill of one request of `isl` tokens,
  run alone ("no in-flight batching, assume isl is long enough to saturate the GPU"): isl / TTFT.
- `decode_throughput_per_gpu` (tokens/s): the best throughput the decode sweep over in-flight
  requests reaches with ITL <= the target, at context length isl + osl / 2.
- The profile is taken "at a fixed ISL/OSL without KV cache reuse".

We leave out what adapts the rule online (load predictors, correction factors: the planner's
`--no-correction` mode) and tensor-parallel choice (one engine per GPU here). Our "profile" is
the engine model's roofline (perf/hardware.py) or the router's calibration (perf/calibration.py),
evaluated at the traffic's mean ISL and OSL. For a fixed budget of instances (Dynamo sizes each
pool on its own and has none), `dynamo_split` divides the budget in proportion to the two pools'
fractional demands, each pool at least one instance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

from pd_plugins.planner.types import Split
from pd_plugins.workloads import TraceRequest


class EngineProfile(Protocol):
    """What the rule reads from a profile: perf.hardware.Hardware (the roofline of a preset) and
    perf.calibration.CalibratedHardware (the router's fitted latency lines) both answer it."""

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float: ...

    def decode_step_s(self, batch: int, kv_tokens: int) -> float: ...


@dataclass(frozen=True)
class DynamoDemand:
    """The rule's intermediate numbers, for a report: instances of demand (fractional) per pool."""

    rate: float
    isl: float
    osl: float
    prefill_tokens_per_s: float   # one prefill instance's profiled throughput
    decode_tokens_per_s: float    # one decode instance's best throughput within the ITL target
    decode_batch: int             # the in-flight requests that throughput is reached at
    prefill_load: float           # rate * isl / prefill_tokens_per_s
    decode_load: float            # rate * osl / decode_tokens_per_s


def prefill_throughput(profile: EngineProfile, isl: float) -> float:
    """Tokens/s of one instance prefilling one `isl`-token prompt alone, nothing cached."""
    n = max(1, round(isl))
    return n / profile.prefill_s(n)


def decode_throughput(profile: EngineProfile, context: float, itl_s: float,
                      max_batch: int = 256, kv_capacity_tokens: int | None = None) -> tuple[float, int]:
    """(tokens/s, batch): the best decode throughput of one instance whose step (ITL) stays
    within `itl_s`, over batches 1..max_batch that fit its KV cache at this context length.
    (0, 0) when not even one request decodes within the target."""
    best, best_batch = 0.0, 0
    ctx = max(1, round(context))
    for batch in range(1, max_batch + 1):
        if kv_capacity_tokens is not None and batch * ctx > kv_capacity_tokens:
            break
        step = profile.decode_step_s(batch, batch * ctx)
        if step > itl_s:
            break  # steps only grow with the batch
        if batch / step > best:
            best, best_batch = batch / step, batch
    return best, best_batch


def dynamo_demand(rate: float, isl: float, osl: float, profile: EngineProfile, itl_s: float, *,
                  max_batch: int = 256, kv_capacity_tokens: int | None = None) -> DynamoDemand:
    prefill_tps = prefill_throughput(profile, isl)
    decode_tps, batch = decode_throughput(profile, isl + osl / 2, itl_s, max_batch, kv_capacity_tokens)
    if decode_tps <= 0:
        raise ValueError(f"one decode request at context {isl + osl / 2:.0f} takes "
                         f"{profile.decode_step_s(1, round(isl + osl / 2)) * 1e3:.1f} ms a step, "
                         f"over the ITL target {itl_s * 1e3:g} ms: no decode replica meets it")
    return DynamoDemand(rate, isl, osl, prefill_tps, decode_tps, batch,
                        rate * isl / prefill_tps, rate * osl / decode_tps)


def traffic_shape(requests: Sequence[TraceRequest]) -> tuple[float, float, float]:
    """(request rate, mean ISL, mean OSL) of a request list, as Dynamo's metrics would see it."""
    if not requests:
        raise ValueError("no requests")
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    rate = len(requests) / span if span > 0 else float(len(requests))
    return (rate, sum(r.input_tokens for r in requests) / len(requests),
            sum(r.output_tokens for r in requests) / len(requests))


def replicas(demand: DynamoDemand) -> Split:
    """Dynamo's own answer: each pool sized on its own, ceil of its demand, at least one."""
    return Split(max(1, math.ceil(demand.prefill_load - 1e-9)),
                 max(1, math.ceil(demand.decode_load - 1e-9)))


def budget_split(demand: DynamoDemand, instances: int) -> Split:
    """`instances` divided in proportion to the two pools' demands (each pool at least one)."""
    if instances < 2:
        raise ValueError(f"a P:D split needs at least 2 instances, got {instances}")
    total = demand.prefill_load + demand.decode_load
    share = demand.prefill_load / total if total > 0 else 0.5
    prefill = min(instances - 1, max(1, round(share * instances)))
    return Split(prefill, instances - prefill)


def dynamo_split(requests: Sequence[TraceRequest], *, profile: EngineProfile, itl_s: float,
                 instances: int | None = None, rate: float | None = None, max_batch: int = 256,
                 kv_capacity_tokens: int | None = None) -> Split:
    """Dynamo's split for this traffic: its own replica counts (`instances` None), or a budget
    divided in its proportions. `rate` overrides the traffic's own request rate."""
    own_rate, isl, osl = traffic_shape(requests)
    demand = dynamo_demand(rate if rate is not None else own_rate, isl, osl, profile, itl_s,
                           max_batch=max_batch, kv_capacity_tokens=kv_capacity_tokens)
    return replicas(demand) if instances is None else budget_split(demand, instances)


def profile_of(sim_base: object) -> EngineProfile:
    """The profile the simulator's engines follow: its hardware, a preset's roofline or the
    router's calibration (`SimConfig(hardware=calibration.hardware())`)."""
    return sim_base.hardware


def kv_capacity_of(sim_base: object) -> int | None:
    """KV tokens one of the simulator's instances holds (None: unknown, no limit)."""
    if getattr(sim_base, "kv_capacity_tokens", None):
        return sim_base.kv_capacity_tokens
    try:
        return sim_base.hardware.kv_capacity_tokens()
    except (AttributeError, ValueError):
        return None
