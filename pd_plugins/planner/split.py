"""The P:D split that serves a workload best, found by replaying it through the cluster simulator.

`plan_split` replays a request list (a public trace or the router's traffic record) through
perf/cluster_sim.py, which runs pd-router's own policy code, over every P:D split of a budget of
instances. Each split is scored by goodput as perf/report.py defines it (DistServe): the highest
request rate at which at least 90% of all requests are served within both the TTFT and the TPOT
SLO, the workload's arrivals scaled to each rate. Its attainment at each rate simulated is the
split's attainment curve. With `target_rate` it finds instead the fewest instances (and their
best split) that serve that rate within the SLOs.

The search is exact under one assumption, that attainment does not rise with the rate (more load
never helps): rates lie on a geometric grid, each split's goodput is found by bisection over it
(a handful of simulations instead of the whole grid), and a split whose attainment already falls
below 90% at the best split's last good rate cannot beat it, so one simulation rules it out.
Splits are tried from Dynamo's proportions outwards (dynamo_rule.py), so the first is usually
near the best and most others are ruled out at once. The unit tests check the answer against
brute force (every split at every rate).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

import msgspec

from pd_plugins.perf.calibration import load_calibration
from pd_plugins.perf.cluster_sim import SimConfig, simulate
from pd_plugins.perf.hardware import preset as hardware_preset
from pd_plugins.perf.report import Slo, goodput, summarize
from pd_plugins.planner import dynamo_rule
from pd_plugins.planner.types import Split
from pd_plugins.routers.config import PolicySpec
from pd_plugins.routers.policy.scheduler import OUR_PRESETS, PREFIX_SOURCE, preset
from pd_plugins.workloads import HASH_BLOCK_SIZE, TraceRequest, scale_time

TARGET_ATTAINMENT = 0.9   # DistServe's goodput threshold (perf/report.py goodput)
# Our presets reject at this share of the TTFT SLO (headroom for the estimate's error); the
# peers' early rejection (mooncake) at the SLO itself, as published (bench/routing_sim.py does
# the same).
OUR_ADMISSION_HEADROOM = 0.75
GRID_STEPS_PER_DOUBLING = 4   # rate grid: 2**(1/4) = 19% apart
GRID_LOW, GRID_HIGH = 1 / 16, 4   # around the anchor rate; extended upward when passed at the top
GRID_MAX_EXTENSION = 4            # doublings the grid may grow upward


@dataclass
class SplitCurve:
    """One split's measurements: attainment and rejections at each rate simulated."""

    split: Split
    attainment: dict[float, float] = field(default_factory=dict)   # rate -> SLO attainment
    rejected: dict[float, int] = field(default_factory=dict)       # rate -> requests rejected
    goodput: float | None = None   # req/s; None when ruled out early (see `below`)
    below: float | None = None     # ruled out: its goodput is under this rate
    simulations: int = 0
    cpu_s: float = 0.0

    def first_miss(self) -> float:
        """Attainment at the lowest rate it missed (1.0 if none): breaks goodput ties."""
        misses = [r for r, a in self.attainment.items() if a < TARGET_ATTAINMENT]
        return self.attainment[min(misses)] if misses else 1.0


@dataclass
class SplitPlan:
    best: Split
    curve: list[SplitCurve]          # one per split considered, by prefill count
    mode: str                        # "goodput" or "target_rate"
    slo: Slo
    policy: str
    instances: int                   # the budget, or the fewest found for the target rate
    target_rate: float | None = None
    dynamo: Split | None = None      # Dynamo's rule for the same budget (dynamo_rule.py)
    tried: dict[int, float] = field(default_factory=dict)  # target mode: instances -> best attainment
    simulations: int = 0
    wall_s: float = 0.0

    def best_curve(self) -> SplitCurve:
        return next(c for c in self.curve if c.split == self.best)

    def rates(self) -> list[float]:
        return sorted({r for c in self.curve for r in c.attainment})

    def to_json(self) -> dict:
        return {"mode": self.mode, "best": dataclasses.asdict(self.best),
                "instances": self.instances, "target_rate": self.target_rate,
                "slo": dataclasses.asdict(self.slo), "policy": self.policy,
                "dynamo": dataclasses.asdict(self.dynamo) if self.dynamo else None,
                "tried": self.tried, "simulations": self.simulations, "wall_s": self.wall_s,
                "curve": [{"prefill": c.split.prefill, "decode": c.split.decode,
                           "goodput": c.goodput, "below": c.below,
                           "attainment": sorted(c.attainment.items()),
                           "rejected": sorted(c.rejected.items()),
                           "simulations": c.simulations} for c in self.curve]}


def policy_for_slo(policy: str | PolicySpec, slo: Slo) -> PolicySpec:
    """The policy with its early-rejection thresholds set from the SLOs (a preset's defaults
    would reject at another SLO than the one the plan is scored by)."""
    spec = preset(policy) if isinstance(policy, str) else policy
    if spec.admission is not None:
        params = dict(spec.admission.params)
        ours = isinstance(policy, str) and policy in OUR_PRESETS
        params["ttft_slo_ms"] = slo.ttft_s * 1e3 * (OUR_ADMISSION_HEADROOM if ours else 1.0)
        if "tpot_slo_ms" in params:
            params["tpot_slo_ms"] = slo.tpot_s * 1e3
        spec = msgspec.structs.replace(
            spec, admission=msgspec.structs.replace(spec.admission, params=params))
    return spec


def sim_config(*, hardware: str = "llama-3.1-8b@h100", calibration: str | None = None,
               model: str | None = None, kv_capacity_tokens: int | None = None,
               block_tokens: int = HASH_BLOCK_SIZE, host_kv_gb: float = 0.0) -> SimConfig:
    """The simulator's settings for a plan: the router's calibration (a file saved from
    GET /admin/calibration) when given, else a hardware preset's roofline (perf/hardware.py).
    `host_kv_gb`: each instance's host tier for KV copies (CPU offloading; 0: none)."""
    if not (math.isfinite(host_kv_gb) and host_kv_gb >= 0):
        raise ValueError(f"host_kv_gb must be a finite number >= 0, got {host_kv_gb}")
    if kv_capacity_tokens is not None and kv_capacity_tokens < block_tokens:
        raise ValueError(f"--kv-capacity-tokens must be at least one KV block ({block_tokens} "
                         f"tokens), got {kv_capacity_tokens}")
    if calibration:
        cal = load_calibration(calibration, model=model)
        if host_kv_gb > 0 and not cal.kv_bytes_per_token:
            # a host tier's size in tokens is its bytes / kv_bytes_per_token: 0 would hold nothing
            raise ValueError(f"--host-kv-gb {host_kv_gb:g}: the calibration has no "
                             "kv_bytes_per_token (0, the router's default latency prior); set "
                             "latency.kv_bytes_per_token in the router's config and export the "
                             "calibration again, or put it in the calibration file")
        engines = cal.hardware(kv_capacity_tokens)
        engines = dataclasses.replace(engines, host_kv_bytes=host_kv_gb * 1e9)
        return SimConfig(engines, block_tokens=block_tokens)
    return SimConfig(hardware_preset(hardware).with_(host_kv_bytes=host_kv_gb * 1e9),
                     block_tokens=block_tokens, kv_capacity_tokens=kv_capacity_tokens)


@dataclass(frozen=True)
class RateGrid:
    """The rates a search may simulate: `points[:size]` now, up to all of `points` when the best
    split still meets the target at the top (the grid grows upward)."""

    points: tuple[float, ...]
    size: int

    @classmethod
    def around(cls, anchor: float) -> RateGrid:
        steps = GRID_STEPS_PER_DOUBLING
        size = round(math.log2(GRID_HIGH / GRID_LOW) * steps) + 1
        top = size + GRID_MAX_EXTENSION * steps
        return cls(tuple(anchor * GRID_LOW * 2 ** (i / steps) for i in range(top)), size)

    @classmethod
    def of(cls, rates: Sequence[float]) -> RateGrid:
        rates = sorted(set(rates))
        if not rates or rates[0] <= 0:
            raise ValueError(f"rates must be > 0 req/s, got {rates}")
        return cls(tuple(rates), len(rates))

    def rate(self, i: int) -> float:
        return self.points[i]

    def grown(self) -> RateGrid | None:
        if self.size == len(self.points):
            return None
        return dataclasses.replace(self, size=min(len(self.points), self.size + GRID_STEPS_PER_DOUBLING))


class _Simulator:
    """Simulates the workload at a rate on a split; remembers what it has simulated."""

    def __init__(self, requests: Sequence[TraceRequest], sim_base: SimConfig, slo: Slo) -> None:
        if not requests:
            raise ValueError("no requests to plan from")
        self.requests, self.sim_base, self.slo = list(requests), sim_base, slo
        span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
        if span <= 0:
            raise ValueError("the requests all arrive at one instant: no request rate to scale")
        self.native_rate = len(requests) / span
        self.cache: dict[tuple[Split, float], tuple[float, int]] = {}
        self.simulations, self.cpu_s = 0, 0.0

    def run(self, split: Split, rate: float) -> tuple[float, int]:
        """(SLO attainment, rejected requests) of the workload at `rate` req/s on `split`."""
        key = (split, rate)
        if key not in self.cache:
            started = time.process_time()
            config = dataclasses.replace(self.sim_base, prefill_instances=split.prefill,
                                         decode_instances=split.decode)
            result = simulate(scale_time(self.requests, rate / self.native_rate), config)
            s = summarize(result.outcomes, self.slo, result.sim_span_s,
                          cached_tokens=result.prompt_tokens_cached,
                          computed_tokens=result.prefill_tokens_computed,
                          kv_bytes_moved=result.kv_bytes_moved)
            self.cache[key] = (s["slo_attainment"], s["rejected"])
            self.simulations += 1
            self.cpu_s += time.process_time() - started
        return self.cache[key]

    def search(self, split: Split, grid: RateGrid, floor: int | None,
               full: bool = False) -> tuple[SplitCurve, RateGrid]:
        """The split's goodput by bisection over the grid (growing it when the split passes at
        its top). `floor`: the best split's last good index; failing there rules this one out.
        `full`: simulate every rate of the grid instead."""
        curve = SplitCurve(split)
        runs, cpu = self.simulations, self.cpu_s

        def passes(i: int) -> bool:
            rate = grid.rate(i)
            curve.attainment[rate], curve.rejected[rate] = self.run(split, rate)
            return curve.attainment[rate] >= TARGET_ATTAINMENT

        if full:  # every rate of the grid, growing it while the top one passes
            i = 0
            while i < grid.size:
                if passes(i) and i == grid.size - 1 and grid.grown() is not None:
                    grid = grid.grown()
                i += 1
        else:
            lo, hi = -1, grid.size   # lo passes (-1: none known), hi fails (size: none known)
            if floor is not None and floor >= 0:
                if not passes(floor):
                    curve.below = grid.rate(floor)
                lo = floor
            while curve.below is None:
                if hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if passes(mid) else (lo, mid)
                elif hi == grid.size and grid.grown() is not None:  # passed the top: grow
                    grid = grid.grown()
                    hi = grid.size
                else:
                    break
        if curve.below is None:
            rates = sorted(curve.attainment)
            curve.goodput = goodput(rates, [curve.attainment[r] for r in rates], TARGET_ATTAINMENT)
        curve.simulations, curve.cpu_s = self.simulations - runs, self.cpu_s - cpu
        return curve, grid


def _last_good_index(curve: SplitCurve, grid: RateGrid) -> int:
    good = [r for r, a in curve.attainment.items() if a >= TARGET_ATTAINMENT]
    return grid.points.index(max(good)) if good else -1


def _better(a: SplitCurve, b: SplitCurve | None) -> bool:
    """Higher goodput; on a tie, higher attainment where it first missed; then fewer prefills."""
    if b is None:
        return True
    if a.goodput is None:
        return False
    return ((a.goodput, a.first_miss(), -a.split.prefill)
            > (b.goodput or 0.0, b.first_miss(), -b.split.prefill))


# -- worker processes (jobs > 1) ---------------------------------------------------------------
_worker_sim: _Simulator | None = None


def _init_worker(requests, sim_base, slo) -> None:
    global _worker_sim
    _worker_sim = _Simulator(requests, sim_base, slo)


def _search_in_worker(split: Split, grid: RateGrid, floor: int | None, full: bool):
    return _worker_sim.search(split, grid, floor, full)


def splits_from_hint(instances: int, hint: Split | None) -> list[Split]:
    """Every split of `instances`, nearest the hint's prefill share first."""
    centre = (hint.prefill / hint.instances * instances) if hint else instances / 2
    return sorted((Split(p, instances - p) for p in range(1, instances)),
                  key=lambda s: (abs(s.prefill - centre), s.prefill))


def dynamo_hint(requests: Sequence[TraceRequest], sim_base: SimConfig, slo: Slo,
                instances: int | None, rate: float | None = None) -> Split | None:
    """Dynamo's split (dynamo_rule.py) from the simulator's engine profile; None if its rule
    has no answer (no decode batch meets the TPOT SLO)."""
    profile = dynamo_rule.profile_of(sim_base)
    try:
        return dynamo_rule.dynamo_split(requests, profile=profile, itl_s=slo.tpot_s,
                                        instances=instances, rate=rate,
                                        max_batch=sim_base.max_running,
                                        kv_capacity_tokens=dynamo_rule.kv_capacity_of(sim_base))
    except ValueError:
        return None


def anchor_rate(requests: Sequence[TraceRequest], sim_base: SimConfig, slo: Slo,
                instances: int) -> float:
    """The rate Dynamo's rule says `instances` serve at their best split: the grid's centre."""
    rate, isl, osl = dynamo_rule.traffic_shape(requests)
    try:
        d = dynamo_rule.dynamo_demand(1.0, isl, osl, dynamo_rule.profile_of(sim_base), slo.tpot_s,
                                      max_batch=sim_base.max_running,
                                      kv_capacity_tokens=dynamo_rule.kv_capacity_of(sim_base))
    except ValueError:
        return rate
    return instances / (d.prefill_load + d.decode_load)


def plan_split(requests: Sequence[TraceRequest], *, slo: Slo, policy: str | PolicySpec = "default",
               instances: int | None = None, target_rate: float | None = None,
               sim_base: SimConfig, progress: Callable[[str], None] | None = None,
               rates: Sequence[float] | None = None, jobs: int = 1, full_curves: bool = False,
               max_instances: int = 128) -> SplitPlan:
    """The best split of `instances` (by goodput), or with `target_rate` the fewest instances
    whose best split serves that rate within the SLOs. `sim_base`: the simulator's settings
    (hardware or calibration, engine limits); its policy and split are set here. `rates`: the
    rates to search over (default: a geometric grid around Dynamo's estimate of the budget's
    capacity). `jobs` > 1 searches splits in that many processes. `full_curves`: simulate every
    split at every rate (the whole attainment curves; several times the simulations)."""
    if not requests:
        raise ValueError("no requests to plan from")
    if (instances is None) == (target_rate is None):
        raise ValueError("give either a budget of instances or a target rate")
    if instances is not None and instances < 2:
        raise ValueError(f"a P:D split needs at least 2 instances, got {instances}")
    if target_rate is not None and not target_rate > 0:
        raise ValueError(f"target rate must be > 0 req/s, got {target_rate}")
    name = policy if isinstance(policy, str) else "custom"
    sim_base = dataclasses.replace(sim_base, policy=policy_for_slo(policy, slo),
                                   prefix_source=PREFIX_SOURCE.get(name, sim_base.prefix_source))
    started = time.monotonic()
    say = progress or (lambda _msg: None)
    if target_rate is not None:
        plan = _fewest_instances(_Simulator(requests, sim_base, slo), requests, sim_base, slo,
                                 target_rate, max_instances, say)
    else:
        plan = _best_split(requests, sim_base, slo, instances, rates, jobs, full_curves, say)
    plan.policy, plan.wall_s = name, time.monotonic() - started
    return plan


def _best_split(requests, sim_base, slo, instances, rates, jobs, full, say) -> SplitPlan:
    hint = dynamo_hint(requests, sim_base, slo, instances)
    order = splits_from_hint(instances, hint)
    grid = (RateGrid.of(rates) if rates
            else RateGrid.around(anchor_rate(requests, sim_base, slo, instances)))
    curves: list[SplitCurve] = []
    best: SplitCurve | None = None
    total = 0

    def take(curve: SplitCurve, grown: RateGrid) -> None:
        nonlocal best, grid, total
        curves.append(curve)
        total += curve.simulations
        if grown.size > grid.size:
            grid = grown
        if _better(curve, best):
            best = curve
        result = (f"goodput {curve.goodput:.3g} req/s" if curve.goodput is not None
                  else f"ruled out (< {curve.below:.3g} req/s)")
        say(f"[{len(curves)}/{len(order)}] {curve.split}: {result} "
            f"({curve.simulations} simulations, {curve.cpu_s:.1f} s)")

    def floor() -> int | None:
        return _last_good_index(best, grid) if best is not None and best.goodput else None

    if jobs <= 1:
        sim = _Simulator(requests, sim_base, slo)
        for split in order:
            take(*sim.search(split, grid, floor(), full))
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, os.cpu_count() or 1), initializer=_init_worker,
                                 initargs=(list(requests), sim_base, slo)) as pool:
            todo, running = list(order), set()
            # the first split alone: its result is the bound that rules most others out
            running.add(pool.submit(_search_in_worker, todo.pop(0), grid, None, full))
            while running:
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for f in done:
                    take(*f.result())
                while todo and len(running) < jobs:
                    running.add(pool.submit(_search_in_worker, todo.pop(0), grid,
                                            None if full else floor(), full))
    curves.sort(key=lambda c: c.split.prefill)
    return SplitPlan(best.split, curves, "goodput", slo, "", instances, dynamo=hint, simulations=total)


def _fewest_instances(sim: _Simulator, requests, sim_base, slo, target_rate, max_instances,
                      say) -> SplitPlan:
    """Fewest instances whose best split reaches the attainment target at `target_rate`,
    assuming more instances never serve worse (searched up by doubling, then by bisection)."""
    def attain(split: Split) -> float:
        return sim.run(split, target_rate)[0]

    def feasible(n: int) -> bool:
        if n not in tried:
            hint = dynamo_hint(requests, sim_base, slo, n, target_rate)
            best = 0.0
            for split in splits_from_hint(n, hint):
                best = max(best, attain(split))
                if best >= TARGET_ATTAINMENT:
                    break
            tried[n] = best
            say(f"{n} instances: best attainment {best:.3f} at {target_rate:g} req/s "
                f"({'meets' if best >= TARGET_ATTAINMENT else 'misses'} {TARGET_ATTAINMENT:.0%})")
        return tried[n] >= TARGET_ATTAINMENT

    tried: dict[int, float] = {}
    own = dynamo_hint(requests, sim_base, slo, None, target_rate)
    lo, hi = 1, min(max_instances, max(2, own.instances if own else 2))  # 1: no split at all
    while not feasible(hi):
        if hi == max_instances:
            raise ValueError(f"{max_instances} instances do not serve {target_rate:g} req/s "
                             f"within {slo} (attainment {tried[hi]:.3f})")
        lo, hi = hi, min(max_instances, 2 * hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    curves = []
    for split in (Split(p, hi - p) for p in range(1, hi)):
        attainment, rejected = sim.run(split, target_rate)
        curves.append(SplitCurve(split, {target_rate: attainment}, {target_rate: rejected}))
    best = max(curves, key=lambda c: (c.attainment[target_rate], -c.split.prefill))
    return SplitPlan(best.split, curves, "target_rate", slo, "", hi, target_rate=target_rate,
                     dynamo=own, tried=dict(sorted(tried.items())), simulations=sim.simulations)


def format_table(plan: SplitPlan) -> str:
    """The attainment curve per split, as a Markdown table (rates in req/s)."""
    rates = plan.rates()
    head = ["split", "goodput (req/s)" if plan.mode == "goodput" else "attainment",
            *(f"{r:.3g}" for r in rates), "rejected (top rate)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in plan.curve:
        mark = " **best**" if c.split == plan.best else ""
        mark += " (Dynamo)" if plan.dynamo is not None and c.split == plan.dynamo else ""
        if plan.mode == "goodput":
            score = f"{c.goodput:.3g}" if c.goodput is not None else f"< {c.below:.3g}"
        else:
            score = f"{c.attainment[plan.target_rate]:.3f}"
        cells = [f"{c.attainment[r]:.2f}" if r in c.attainment else "" for r in rates]
        top = max(c.rejected) if c.rejected else None
        lines.append("| " + " | ".join([f"{c.split}{mark}", score, *cells,
                                        str(c.rejected[top]) if top is not None else ""]) + " |")
    return "\n".join(lines)
