"""Planner benchmark (simulator): a workload whose mix shifts, served by the same number of
instances split three ways.

The workload (`workload`): a code-completion phase (Azure code trace: long prompts, short
answers, no reuse), a chat phase (Azure conversation trace: shorter prompts, longer answers),
then a long-context conversation phase (Mooncake conversation trace: prompts of 12k tokens on
average with a heavy tail, sharing prefixes in 512-token blocks), PHASE_S each, each fading into
the next over FADE_S, each at a fixed multiple of its trace's mean rate, with the trace's own
arrival pattern; each repeat takes its phases from other offsets of the traces. The multiples
put each phase near what its own best split serves, where no static split serves all three
(docs/benchmarks.md, "Planner", says why). Strategies, at INSTANCES instances:

- `static`: every fixed P:D split, the best one chosen in hindsight (per repeat);
- `dynamo`: Dynamo's sizing rule (planner/dynamo_rule.py) applied every INTERVAL_S to the last
  WINDOW_S of traffic, the budget divided in its proportions, applied at once by live role changes;
- `live`: LivePlanner (planner/live.py): a re-plan per interval, with hysteresis.

Both dynamic strategies start from an even split and move instances through the simulator's role
changes (a moving instance drains first). Reported: SLO attainment and goodput at the nominal rate
(requests served within both SLOs per second), DistServe goodput over a sweep of rate multiples
(the highest rate with attainment >= 90%), and attainment per interval over time.

A second workload (`--workload answer_shift`, ANSWER_SHIFT) shifts within one trace, where
Dynamo's rule misses (bench/planner_phase.py): the Mooncake conversation trace's requests with
short answers (under 100 tokens), then those with long answers (400 and more) for three times as
long, then short answers again. Each workload writes its own results file and docs section
(WORKLOADS).

    .venv/bin/python -m bench.planner            # ~20 min on one core
    .venv/bin/python -m bench.planner --quick    # one repeat, two rates (x0.9, x1)
    .venv/bin/python -m bench.planner --render   # tables and plot from bench/results/planner.json
    .venv/bin/python -m bench.planner --workload answer_shift --jobs 2   # ~40 min of one core
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import random
import statistics
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor

from bench import common
from pd_plugins.perf.cluster_sim import SimConfig, simulate
from pd_plugins.perf.hardware import preset as hardware_preset
from pd_plugins.perf.report import Slo, goodput
from pd_plugins.planner.dynamo_rule import dynamo_split
from pd_plugins.planner.live import Hysteresis, LivePlanner
from pd_plugins.planner.split import Split, policy_for_slo
from pd_plugins.workloads import HASH_BLOCK_SIZE, blocks_for, load_trace

HARDWARE = "qwen3-30b-a3b@h100"  # MoE: cheap prefill, decode steps that read many experts
INSTANCES = 8
SLO = Slo(ttft_s=2.0, tpot_s=0.05)
# A policy that always disaggregates: the router's default prefills short prompts on the decode
# worker, which absorbs much of a shift by itself (see docs/benchmarks.md, "Planner")
POLICY = "prefix_cache"
PHASES = (("azure_code", 17.0), ("azure_conv", 11.0), ("mooncake_conv", 0.65))  # trace, x its rate
PHASE_S = 150.0
FADE_S = 60.0   # each phase fades into the next over this long (a mix shifts, the load stays)
INTERVAL_S = 15.0
WINDOW_S = 15.0
HYSTERESIS = Hysteresis(margin=0.05, min_dwell_s=60.0)
SEEDS = (0, 1, 2)
RATE_SCALES = (0.8, 0.9, 1.0, 1.1, 1.2)  # x the nominal rates, for DistServe goodput
QUICK_SCALES = (0.9, 1.0)
ID_STRIDE = 1 << 42  # each phase's block ids apart: Azure ids count up from the same base
PASS_STRIDE = 1 << 32  # and each pass over its trace (a trace holds under 2**32 ids)


# Traces cut from one above by their answers' length (bench/planner_phase.py, ANSWER_SHIFT):
# name -> (trace, fewest output tokens, fewer than this many or None)
ANSWER_CUTS = {"mooncake_long_answers": ("mooncake_conv", 400, None),
               "mooncake_short_answers": ("mooncake_conv", 0, 100)}
# The second workload: one trace's requests, the mix shifting from short answers (prompt-heavy,
# like code completion) to long ones (chat) and back; the long phase is longer, so that long
# answers are a third of the requests, not an eighth (they come about 3x less often)
ANSWER_SHIFT = (("mooncake_short_answers", 13.0, 150.0), ("mooncake_long_answers", 2.0, 450.0),
                ("mooncake_short_answers", 13.0, 150.0))


WHY_AZURE_MOONCAKE = (
    "Why this workload. The issue asks for a mix built from the Azure and Mooncake "
    "traces, in which prefix reuse shrinks the prefill by \"an amount no formula from "
    "average lengths captures\". The Azure traces carry no prefix information; on them "
    "Dynamo's rule, which sizes both pools from mean lengths with a profile taken "
    "without KV reuse, is close to what the simulated engines do (the previous version "
    "of this benchmark, code, chat, code again, all Azure: LivePlanner 0.95x Dynamo's "
    "rule). The third phase is the Mooncake conversation trace, the one public trace "
    "with real prefix sharing (chained 512-token block hashes; the simulator caches at "
    "512 tokens in the prefill and the decode instances alike, a prefill computes only "
    "what its cache lacks, a decode pulls only what its cache lacks). Its prompts are "
    "long (12k tokens on average, a tail past 100k) and share prefixes: reuse shrinks "
    "its prefill, and the tail of long prompts (4% of them take more than the 2 s TTFT "
    "SLO to prefill on an idle instance of this hardware) blocks the prefill queues and "
    "grows it; a mean length sees neither. Measured, not assumed: alone, at this "
    "rate, the first repeat's Mooncake requests were served best by 4P:4D (0.93 "
    "attainment) and 2P:6D served 0.77; in the run (table below, where 4P:4D still "
    "works off the chat phase's queue) 3P:5D serves the phase 0.84, 2P:6D 0.72, and "
    "Dynamo's rule, from its mean lengths, holds 2P or 3P there. The order is code, "
    "chat, Mooncake rather than code, "
    "Mooncake, code: on this hardware and SLO the Mooncake phase wants about the split "
    "the code phase wants (4-5P against 5-6P), so that order would hardly shift the "
    "split. How much reuse the phase gets is measured too (per phase, below): little, "
    "a few percent of its prompt tokens, against 37% over the whole trace, because a GPU "
    "prefix cache holds 112k tokens of this model per instance while half of the "
    "trace's repeated blocks come back only after 2.5M tokens of other blocks (LRU "
    "distance over a run of 1,300 requests), and the simulator has no host-memory tier. "
    "The Mooncake phase's rate (0.65x its trace's mean, 2.2 req/s) is near what its "
    "best split serves (its ceiling is about 0.95 attainment: the tail above misses the "
    "TTFT SLO on any split); requests whose prompt and answer exceed one instance's KV "
    "(0.5% of the trace) are left out, as vLLM refuses a request over max_model_len. "
    "Goodput counts requests, so this phase (2.2 req/s against 40-60 in the Azure "
    "phases) weighs little in the headline numbers: the per-phase table shows each "
    "strategy in each phase. As before, each phase runs near what its own best split "
    "serves, every repeat takes other requests, a higher rate replays the same requests "
    "faster, and each phase fades into the next over a minute (a step of the whole load "
    "into a decode pool at its KV limit leaves a queue that no controller reacting "
    "after the fact can work off, and real mixes shift over minutes). Both dynamic "
    "strategies plan from the last interval (15 s)."
)
WHY_ANSWER_SHIFT = (
    "Why this workload. On the mix above Dynamo's rule is within a few percent of the best any "
    "strategy serves: the Azure phases are most of its requests, and on them the rule's mean "
    "lengths tell it what the engines need. Where it misses is requests with long prompts and long "
    "answers (\"Planner: one phase alone\" below): it sizes the decode pool from the window's "
    "mean answer without the time each answer holds its KV. This workload shifts between the two "
    "kinds of request one trace holds: the Mooncake conversation trace's requests with answers "
    "under 100 tokens (prompt-heavy, like code completion: they want prefill instances), then "
    "those with answers of 400 tokens and more (chat with long answers: they want decode "
    "instances and KV room), then short answers again. The long-answer phase lasts three times "
    "as long, so that long answers are a third of the requests (an eighth with phases of equal "
    "length: at these rates short answers come about 3x as often), as goodput counts requests. "
    "Each phase's rate is near what its own best "
    "split serves, so that no fixed split serves both: the short answers want 6-7 prefill "
    "instances, the long ones 3-4. The rates swept reach below the nominal one: at x1 no "
    "strategy holds 90% attainment over the whole run."
)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A benchmark workload: its phases, the rates swept, where its results and section go."""

    phases: tuple
    scales: tuple            # x the nominal rates, for DistServe goodput
    seeds: tuple             # repeats, each from other offsets of the traces
    section: str             # its markers in docs/benchmarks.md
    title: str
    results: str             # file name under bench/results, and its plot's under docs/img
    png: str
    why: str                 # the section's paragraph on why this workload


WORKLOADS = {
    "azure_mooncake": Workload(PHASES, RATE_SCALES, SEEDS, "planner",
                               "Planner: live role changes on a shifting mix", "planner.json",
                               "planner.png", WHY_AZURE_MOONCAKE),
    # every strategy is under 90% attainment at x1 here: the sweep reaches down for DistServe;
    # 90% is near what any split serves (a few percent of the prompts take longer than the TTFT
    # SLO to prefill on an idle instance), so DistServe goodput jumps: five repeats
    "answer_shift": Workload(ANSWER_SHIFT, (0.5, 0.6, 0.7, 0.8, 0.9, 1.0), (0, 1, 2, 3, 4),
                             "planner-answer-shift",
                             "Planner: a shift in answer length (Mooncake)",
                             "planner_answer_shift.json", "planner_answer_shift.png",
                             WHY_ANSWER_SHIFT),
}


@functools.lru_cache(maxsize=None)
def cached_trace(name: str) -> list:
    """The trace without the requests no instance can hold: vLLM refuses a request longer than
    max_model_len, which can be no more than one instance's KV cache (Mooncake's longest
    conversations, 0.5% of them, are over the 112k tokens of HARDWARE)."""
    if name in ANSWER_CUTS:
        base, fewest, under = ANSWER_CUTS[name]
        return [r for r in cached_trace(base)
                if r.output_tokens >= fewest and (under is None or r.output_tokens < under)]
    blocks = base_config().hardware.kv_capacity_tokens() // HASH_BLOCK_SIZE
    return [r for r in load_trace(name)
            if blocks_for(r.input_tokens + r.output_tokens, r.block_tokens) <= blocks]


def phase_bounds(phases: tuple = PHASES) -> list[tuple[float, float]]:
    """(start, end) of each phase: a phase is (trace, rate multiple[, seconds]), PHASE_S unless
    it says how long."""
    out, at = [], 0.0
    for phase in phases:
        length = phase[2] if len(phase) > 2 else PHASE_S
        out.append((at, at + length))
        at += length
    return out


def workload(seed: int, scale: float, phases: tuple = PHASES) -> list:
    """The phases one after the other (PHASE_S each unless a phase says how long: `phase_bounds`),
    each fading into the next over FADE_S.

    A phase is a run of consecutive requests of its trace, with the trace's own arrival times,
    from an offset drawn by seed: as many as its rate (`scale` x its multiple of the trace's
    mean rate) asks for over the time the phase is present, their arrivals compressed to fill
    that time (past the trace's end the run goes on from its start, with other block ids).
    Across a fade each phase's requests are kept with a weight that ramps linearly (the two add
    to 1): the mix shifts, the load stays. The same offsets and draws at every scale: a higher
    scale replays the same requests, closer together, and the next ones."""
    bounds, half = phase_bounds(phases), FADE_S / 2
    end = bounds[-1][1]
    out = []
    for k, (name, rate_x, *_) in enumerate(phases):
        trace = cached_trace(name)
        n, span = len(trace), trace[-1].arrival_s - trace[0].arrival_s
        draws = random.Random(seed * len(phases) + k)
        start, stop = max(0.0, bounds[k][0] - half), min(end, bounds[k][1] + half)
        count = round(n / span * rate_x * scale * (stop - start))
        first = draws.randrange(n)
        # trace time of the run's j-th request, passes laid end to end (a mean gap between them)
        at = [trace[j % n].arrival_s + (j // n) * (span + span / n) for j in range(first, first + count + 1)]
        squeeze = (at[-1] - at[0]) / (stop - start)
        for j in range(first, first + count):
            t = start + (at[j - first] - at[0]) / squeeze
            weight = min(1.0, (t - start) / FADE_S if k > 0 else 1.0,
                         (stop - t) / FADE_S if k < len(phases) - 1 else 1.0)
            if draws.random() < weight:
                ids = (k + 1) * ID_STRIDE + (j // n) * PASS_STRIDE
                out.append(dataclasses.replace(trace[j % n], arrival_s=t,
                                               block_hashes=tuple(h + ids for h in trace[j % n].block_hashes)))
    out.sort(key=lambda r: r.arrival_s)
    return [dataclasses.replace(r, request_id=i) for i, r in enumerate(out)]


def base_config() -> SimConfig:
    return SimConfig(hardware_preset(HARDWARE), policy=policy_for_slo(POLICY, SLO))


def dynamo_controller(config: SimConfig, instances: int = INSTANCES):
    """Dynamo's rule as a SimConfig.role_controller: every interval, over the last WINDOW_S."""
    recent: deque = deque()

    def control(window):
        recent.extend(window.arrivals)
        while recent and recent[0].arrival_s < window.end_s - WINDOW_S:
            recent.popleft()
        if len(recent) < 2 or window.moving:
            return None
        split = dynamo_split(list(recent), profile=config.hardware, itl_s=SLO.tpot_s,
                             instances=instances, kv_capacity_tokens=config.hardware.kv_capacity_tokens())
        return (split.prefill, split.decode)

    return control


def run(job: tuple) -> dict:
    """job: (strategy, prefill instances, seed, scale, phases)."""
    strategy, prefill, seed, scale, phases = job
    requests = workload(seed, scale, phases)
    config = dataclasses.replace(base_config(), prefill_instances=prefill,
                                 decode_instances=INSTANCES - prefill, seed=seed)
    planner = None
    if strategy == "dynamo":
        config = dataclasses.replace(config, role_controller=dynamo_controller(config),
                                     control_interval_s=INTERVAL_S)
    elif strategy == "live":
        planner = LivePlanner(SLO, base_config(), POLICY, WINDOW_S, INTERVAL_S, HYSTERESIS)
        config = dataclasses.replace(config, role_controller=planner.sim_controller(),
                                     control_interval_s=INTERVAL_S)
    started = time.process_time()
    result = simulate(requests, config)
    span = max(r.arrival_s for r in requests)
    met = [o.status == "ok" and SLO.met(o.ttft_s, o.tpot_s) for o in result.outcomes]
    windows = int(span // INTERVAL_S) + 1
    per_window = [[0, 0] for _ in range(windows)]
    for o, ok in zip(result.outcomes, met):
        w = per_window[int(o.arrival_s // INTERVAL_S)]
        w[0] += ok
        w[1] += 1
    return {"strategy": strategy, "prefill": prefill, "seed": seed, "scale": scale,
            "requests": len(requests), "rate": len(requests) / span,
            "attainment": sum(met) / len(met), "goodput_at_load": sum(met) / span,
            "rejected": sum(o.status == "rejected" for o in result.outcomes),
            # per phase: the share of its prompts' tokens found in a prefix cache
            "cached_share": cached_share_per_phase(requests, result, phases),
            "lost": sum(o.status == "failed" for o in result.outcomes),
            "window_attainment": [m / n if n else None for m, n in per_window],
            "window_requests": [n for _, n in per_window],
            "split_log": result.split_log, "moves": len(result.role_moves),
            "planner_simulations": sum(len(d.scores) for d in planner.log) if planner else 0,
            "cpu_s": time.process_time() - started}


def cached_share_per_phase(requests: list, result, phases: tuple = PHASES) -> list[float]:
    """Per phase (by arrival, fades split at their middle): cached / all prompt tokens."""
    cached, total = [0] * len(phases), [0] * len(phases)
    bounds = phase_bounds(phases)
    for r, o in zip(requests, result.outcomes):  # both in request id order
        k = next((i for i, (_, stop) in enumerate(bounds) if r.arrival_s < stop), len(bounds) - 1)
        cached[k] += o.cached_tokens
        total[k] += r.input_tokens
    return [c / t if t else 0.0 for c, t in zip(cached, total)]


def study(quick: bool, jobs: int, name: str = "azure_mooncake") -> dict:
    phases = WORKLOADS[name].phases
    seeds = WORKLOADS[name].seeds[:1] if quick else WORKLOADS[name].seeds
    scales = QUICK_SCALES if quick else WORKLOADS[name].scales
    todo = [("static", p, s, x, phases) for s in seeds for x in scales for p in range(1, INSTANCES)]
    todo += [(k, INSTANCES // 2, s, x, phases) for s in seeds for x in scales
             for k in ("dynamo", "live")]
    todo.sort(key=lambda j: (j[0] == "static", -j[3]))  # the slow ones first
    runs = []
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        results = (map(run, todo) if jobs <= 1
                   else stack.enter_context(ProcessPoolExecutor(jobs)).map(run, todo))
        for i, out in enumerate(results, 1):
            runs.append(out)
            print(f"[{i}/{len(todo)} {time.monotonic() - started:.0f} s] {out['strategy']} "
                  f"P={out['prefill']} seed {out['seed']} x{out['scale']}: attainment "
                  f"{out['attainment']:.3f}, {out['moves']} moves, "
                  f"{out['planner_simulations']} planner simulations, {out['cpu_s']:.0f} s CPU",
                  flush=True)
    return {"runs": runs, "meta": {
        "hardware": HARDWARE, "instances": INSTANCES, "slo": dataclasses.asdict(SLO),
        "policy": POLICY, "workload": name, "phases": [phase[:2] for phase in phases],
        "bounds": phase_bounds(phases), "phase_s": PHASE_S, "fade_s": FADE_S,
        "interval_s": INTERVAL_S,
        "window_s": WINDOW_S, "hysteresis": dataclasses.asdict(HYSTERESIS), "seeds": seeds,
        "headroom": LivePlanner.headroom, "replay_lead": LivePlanner.replay_lead, "jobs": jobs,
        "scales": scales, "machine": common.machine(), "wall_s": time.monotonic() - started,
        "date": time.strftime("%Y-%m-%d")}}


# -- the report ---------------------------------------------------------------------------------

def per_seed(results: dict) -> dict[int, dict[str, dict]]:
    """seed -> strategy -> {goodput_at_load, attainment, goodput (DistServe), ...} with static
    the best split in hindsight (by goodput over the sweep, then attainment at the nominal rate)."""
    runs, meta = results["runs"], results["meta"]
    out: dict[int, dict[str, dict]] = {}
    for seed in meta["seeds"]:
        mine = [r for r in runs if r["seed"] == seed]
        row = {}

        def curve(rs):
            rs = sorted(rs, key=lambda r: r["scale"])
            return goodput([r["rate"] for r in rs], [r["attainment"] for r in rs])

        def nominal(rs):
            return next(r for r in rs if r["scale"] == 1.0)

        statics = {}
        for p in range(1, meta["instances"]):
            rs = [r for r in mine if r["strategy"] == "static" and r["prefill"] == p]
            statics[p] = (curve(rs), nominal(rs)["attainment"], rs)
        best_p = max(statics, key=lambda p: statics[p][:2])
        for name, rs in (("static", statics[best_p][2]),
                         *((k, [r for r in mine if r["strategy"] == k]) for k in ("dynamo", "live"))):
            n = nominal(rs)
            row[name] = {"goodput": curve(rs), "attainment": n["attainment"],
                         "goodput_at_load": n["goodput_at_load"], "moves": n["moves"],
                         "lost": n["lost"], "window_attainment": n["window_attainment"],
                         "split_log": n["split_log"], "prefill": n["prefill"],
                         "saturated": all(r["attainment"] >= 0.9 for r in rs),
                         "lowest_rate": min(r["rate"] for r in rs)}
        row["static_all"] = {p: v[1] for p, v in statics.items()}
        out[seed] = row
    return out


def phase_oracle(results: dict) -> dict[int, dict]:
    """seed -> {"goodput", "attainment", "goodput_at_load", "saturated"} of choosing the static
    split best for each phase in hindsight (the most of the phase's requests within the SLOs),
    switched at the phase boundaries at no cost, chosen again at each rate. Built from the static
    runs' per-interval attainment, each interval weighted by the requests that arrived in it; an
    interval belongs to the phase its middle falls in, so a fade counts half to each side. An
    estimate, not a strict bound: each static run's phase starts from the queue its own split
    left, where a switch would inherit another split's."""
    runs, meta = results["runs"], results["meta"]
    bounds, step = meta_bounds(meta), meta["interval_s"]
    phases = tuple((name, x, stop - start)  # (results keep a phase's length in its bounds)
                   for (name, x, *_), (start, stop) in zip(meta["phases"], bounds))
    out: dict[int, dict] = {}
    for seed in meta["seeds"]:
        rates, attainments = [], []
        for scale in meta["scales"]:
            statics = [r for r in runs if r["seed"] == seed and r["scale"] == scale
                       and r["strategy"] == "static"]
            arrived = statics[0].get("window_requests")
            if arrived is None:  # results from before run() kept them: the workload again
                arrived = [0] * len(statics[0]["window_attainment"])
                for request in workload(seed, scale, phases):
                    arrived[min(int(request.arrival_s // step), len(arrived) - 1)] += 1
                if sum(arrived) != statics[0]["requests"]:
                    raise ValueError(f"workload({seed}, {scale}) is not the one measured")
            met = 0.0
            for start, stop in bounds:
                mine = [i for i in range(len(arrived)) if start <= (i + 0.5) * step < stop]
                met += max(sum(arrived[i] * (r["window_attainment"][i] or 0.0) for i in mine)
                           for r in statics)
            rates.append(statics[0]["rate"])
            attainments.append(met / sum(arrived))
        nominal = meta["scales"].index(1.0)
        out[seed] = {"goodput": goodput(rates, attainments), "attainment": attainments[nominal],
                     "goodput_at_load": attainments[nominal] * rates[nominal],
                     "saturated": all(a >= 0.9 for a in attainments)}
    return out


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{statistics.mean(values):.3g} ± {statistics.stdev(values):.2g}"


def phase_attainment(run: dict, meta: dict) -> list[float]:
    """Per phase: the mean per-interval attainment over its steady part (outside the fades)."""
    step, fade = meta["interval_s"], meta.get("fade_s", 0.0)
    bounds = meta_bounds(meta)
    out = []
    for k, (start, stop) in enumerate(bounds):
        lo, hi = start + (fade / 2 if k else 0), stop - (fade / 2 if k < len(bounds) - 1 else 0)
        vals = [a for i, a in enumerate(run["window_attainment"])
                if a is not None and lo <= i * step and (i + 1) * step <= hi]
        out.append(sum(vals) / len(vals) if vals else float("nan"))
    return out




def meta_bounds(meta: dict) -> list:
    """Each phase's (start, end) in a result's meta (results before phases had lengths: PHASE_S;
    render() writes them into the results for the plot)."""
    return meta.get("bounds") or [(k * meta["phase_s"], (k + 1) * meta["phase_s"])
                                  for k in range(len(meta["phases"]))]


def per_phase_reference(oracle: dict[int, dict], seeds: dict[int, dict]) -> str:
    """The sentence on phase_oracle(): its goodput and its ratios to the best static split."""
    def ratio(metric: str) -> str:
        rs = [oracle[s][metric] / seeds[s]["static"][metric] for s in seeds
              if seeds[s]["static"][metric] and oracle[s][metric]]
        return f"{spread(rs)}x" if rs else "no finite ratio (under 90% at every rate swept)"

    distserve = spread([o["goodput"] for o in oracle.values()])
    if not any(o["goodput"] for o in oracle.values()):
        distserve = "none (under 90% at every rate swept)"
    elif any(o["saturated"] for o in oracle.values()):
        distserve = f">= {distserve} (at >= 90% at every rate swept in some repeats)"
    return ("What choosing a split per phase gives: the static split best for each phase in "
            "hindsight, switched at the phase boundaries at no cost (`phase_oracle()`, an "
            "estimate from the static runs' per-interval attainment): goodput at the nominal "
            f"rate {spread([o['goodput_at_load'] for o in oracle.values()])} req/s (attainment "
            f"{spread([o['attainment'] for o in oracle.values()])}), DistServe goodput "
            f"{distserve} req/s; over the best static split {ratio('goodput_at_load')} and "
            f"{ratio('goodput')}. A planner does better only by moving within a phase (and "
            "worse by the cost of its moves and of reacting after a shift).")


def markdown(results: dict) -> str:
    meta, runs = results["meta"], results["runs"]
    seeds = per_seed(results)
    names = {"static": "best static split (hindsight)", "dynamo": "Dynamo's rule every window",
             "live": "LivePlanner (live role changes)"}
    name = meta.get("workload", "azure_mooncake")
    workload = WORKLOADS[name]
    lengths = {stop - start for start, stop in meta_bounds(meta)}
    phases = ", then ".join(
        f"{n} at {x:g}x its mean rate" + ("" if len(lengths) == 1 else f" for {stop - start:.0f} s")
        for (n, x), (start, stop) in zip(meta["phases"], meta_bounds(meta)))
    each = f"{lengths.pop():.0f} s each, " if len(lengths) == 1 else ""
    command = "bench.planner" + ("" if name == "azure_mooncake" else f" --workload {name}")
    lines = [f"<!-- {workload.section}:start -->", f"## {workload.title}", "",
             f"`.venv/bin/python -m {command}` (simulator; {meta['date']}; {meta['machine']}; "
             f"{meta['wall_s'] / 60:.0f} min in {meta.get('jobs', 1)} process(es), beside other "
             "work). "
             f"{meta['instances']} instances of {meta['hardware']} (engine model), policy "
             f"`{meta['policy']}`, SLOs {Slo(**meta['slo'])}. Workload (`workload()`): {phases}, "
             f"{each}each fading into the next over "
             f"{meta.get('fade_s', 0):.0f} s; a phase is a run of consecutive requests of its "
             "trace with the trace's own arrival pattern, compressed to the phase's rate. "
             f"{len(meta['seeds'])} repeats from other offsets of the traces (mean ± stdev over "
             f"them); rates x{', x'.join(map(str, meta['scales']))} of the nominal one for "
             "DistServe goodput. Dynamic strategies start at "
             f"{meta['instances'] // 2}P:{meta['instances'] // 2}D and re-plan every "
             f"{meta['interval_s']:.0f} s from the last {meta['window_s']:.0f} s; LivePlanner's "
             f"hysteresis: margin {meta['hysteresis']['margin']:g}, dwell "
             f"{meta['hysteresis']['min_dwell_s']:.0f} s (a reversal within it needs "
             f"{1 + meta['hysteresis'].get('reverse_margin', 0):g}x, unless the split misses "
             "the window at its own rate), one re-plan per interval; "
             f"it judges each split at the window's rate and at {meta.get('headroom', 1):g}x it, "
             "and simulates Dynamo's rule's split for the window beside its climb"
             + ("; the answers in progress replay their prompts ahead of the window, not in its "
                "way (docs/planner.md)" if meta.get("replay_lead") else "") + ".",
             "",
             workload.why, "",
             "| strategy | goodput at the nominal rate (req/s within SLO) | SLO attainment | "
             "DistServe goodput (req/s, attainment >= 90%) | role moves | requests lost |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for k in ("static", "dynamo", "live"):
        rows = [seeds[s][k] for s in seeds]
        label = names[k] + (" " + ", ".join(f"{r['prefill']}P" for r in rows) if k == "static" else "")
        gp = spread([r["goodput"] for r in rows])
        if not any(r["goodput"] for r in rows):
            gp = f"< {min(r['lowest_rate'] for r in rows):.3g} (under 90% at every rate swept)"
        elif any(r["saturated"] for r in rows):
            gp = (f">= {gp} ({sum(r['saturated'] for r in rows)} of {len(rows)} repeats at >= 90% "
                  "at every rate swept: the top rate counted)")
        lines.append(f"| {label} | {spread([r['goodput_at_load'] for r in rows])} | "
                     f"{spread([r['attainment'] for r in rows])} | {gp} | "
                     f"{spread([r['moves'] for r in rows])} | {sum(r['lost'] for r in rows)} |")
    lines.append("")
    ratios, verdict = [], []
    for metric, label in (("goodput_at_load", "goodput at the nominal rate"),
                          ("goodput", "DistServe goodput")):
        for base, target in (("static", 1.2), ("dynamo", 1.1)):
            rs = [seeds[s]["live"][metric] / seeds[s][base][metric] for s in seeds
                  if seeds[s][base][metric] and seeds[s]["live"][metric]]
            if rs:
                ratios.append(f"{label}, LivePlanner / {names[base].split(' (')[0]}: "
                              f"{spread(rs)}x")
                verdict.append(f"{label} vs {names[base].split(' (')[0]} "
                               f"{'met' if statistics.mean(rs) >= target else 'missed'} "
                               f"({statistics.mean(rs):.2f}x, target {target}x)")
    # at the nominal rate no strategy serves more than every request: the ratio's ceiling
    ceiling = [next(r["rate"] for r in runs if r["seed"] == s and r["scale"] == 1.0
                    and r["strategy"] == "dynamo") / seeds[s]["dynamo"]["goodput_at_load"]
               for s in seeds if seeds[s]["dynamo"]["goodput_at_load"]]
    lines += ["Ratios per repeat (mean ± stdev; a DistServe ratio is left out where either side is "
              "under 90% at every rate swept): " + "; ".join(ratios) + ". The issue's target, "
              ">= 1.2x the best static split and >= 1.1x Dynamo's rule: "
              + "; ".join(verdict) + "."
              + (f" At the nominal rate no strategy can reach more than {spread(ceiling)}x Dynamo's "
                 "rule (every request served within the SLOs, over what it serves)."
                 if ceiling else ""), ""]
    oracle = phase_oracle(results)
    lines += [per_phase_reference(oracle, seeds), ""]
    lines += ["Each static split and each dynamic strategy per phase at the nominal rate (mean "
              "per-interval attainment in the phase's steady part, outside the fades; mean over "
              "repeats) and over the run. The phases run in sequence: a phase inherits the queue "
              "the one before left.",
              "",
              "| split | " + " | ".join(f"{n} ({k + 1})" for k, (n, _) in enumerate(meta["phases"]))
              + " | whole run |", "|---|" + "---:|" * (len(meta["phases"]) + 1)]
    for p in range(1, meta["instances"]):
        mine = [r for r in runs if r["strategy"] == "static" and r["prefill"] == p
                and r["scale"] == 1.0]
        per = [phase_attainment(r, meta) for r in mine]
        cells = [f"{statistics.mean(v[k] for v in per):.2f}" for k in range(len(meta["phases"]))]
        lines.append(f"| {p}P:{meta['instances'] - p}D | " + " | ".join(cells)
                     + f" | {spread([seeds[s]['static_all'][p] for s in seeds])} |")
    for k in ("dynamo", "live"):
        mine = [r for r in runs if r["strategy"] == k and r["scale"] == 1.0]
        per = [phase_attainment(r, meta) for r in mine]
        cells = [f"{statistics.mean(v[i] for v in per):.2f}" for i in range(len(meta["phases"]))]
        lines.append(f"| {names[k].split(' (')[0]} | " + " | ".join(cells)
                     + f" | {spread([seeds[s][k]['attainment'] for s in seeds])} |")
    nominal = [r for r in runs if r["scale"] == 1.0 and "cached_share" in r]
    if nominal:
        shares = [statistics.mean(r["cached_share"][k] for r in nominal)
                  for k in range(len(meta["phases"]))]
        lines += ["", "Prompt tokens found in a prefix cache, per phase (every run at the nominal "
                  "rate): " + ", ".join(f"{n} ({k + 1}) {v:.1%}" for k, ((n, _), v)
                                        in enumerate(zip(meta["phases"], shares))) + "."]
    live = [r for r in runs if r["strategy"] == "live" and r["scale"] == 1.0]
    lines += ["", f"LivePlanner's cost at the nominal rate: "
              f"{spread([r['planner_simulations'] for r in live])} window simulations per run "
              f"({spread([r['cpu_s'] for r in live])} s CPU for the run, its own simulation "
              "included); Dynamo's rule costs nothing to evaluate.", "",
              f"![SLO attainment per interval](img/{workload.png})", "",
              f"<!-- {workload.section}:end -->", ""]
    return "\n".join(lines)


def render(name: str = "azure_mooncake") -> int:
    workload = WORKLOADS[name]
    path = common.RESULTS / workload.results
    results = json.loads(path.read_text())
    results["best_static"] = {str(s): row["static"]["prefill"] for s, row in per_seed(results).items()}
    results["meta"]["bounds"] = meta_bounds(results["meta"])
    path.write_text(json.dumps(results))  # the plotter reads which static split was best, and
    # where each phase starts and ends
    common.publish(workload.section, markdown(results), "planner_plot.py", path,
                   common.IMG / workload.png)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repeat, two rates (x0.9, x1)")
    parser.add_argument("--render", action="store_true", help="only redo tables and plot")
    parser.add_argument("--jobs", type=int, default=1, help="processes (default 1: this one)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="azure_mooncake",
                        help="azure_mooncake (default): Azure code, Azure chat, Mooncake; "
                             "answer_shift: Mooncake short answers, long answers, short again")
    args = parser.parse_args()
    if not args.render:
        results = study(args.quick, args.jobs, args.workload)
        path = common.RESULTS / WORKLOADS[args.workload].results
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results))
    return render(args.workload)


if __name__ == "__main__":
    sys.exit(main())
