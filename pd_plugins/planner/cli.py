"""pd-planner: the P:D split for a workload (docs/planner.md).

    pd-planner --trace mooncake_conv --duration 600 --slo-ttft-ms 5000 --slo-tpot-ms 50 \\
               --instances 16 --plot split.png
    pd-planner --record traffic.jsonl --calibration calibration.json --slo-ttft-ms 2000 \\
               --slo-tpot-ms 50 --target-rate 20

Prints the best split and the attainment curve per split (a Markdown table); progress goes to
stderr, one line per split.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from pd_plugins.perf.cluster_sim import SimConfig
from pd_plugins.perf.hardware import PRESETS
from pd_plugins.perf.report import Slo
from pd_plugins.planner.split import SplitPlan, format_table, plan_split, sim_config
from pd_plugins.routers.config import ConfigError
from pd_plugins.routers.policy.scheduler import DEFAULT_POLICY, PRESETS as POLICIES
from pd_plugins.workloads import TRACES, first_n, load_trace, slice_window, spread_bursts
from pd_plugins.workloads.traffic_record import load_traffic_record

DEFAULT_HARDWARE = "llama-3.1-8b@h100"
# Mooncake records arrivals in 3 s batches: spread each over its 3 s (as bench/routing_sim.py does)
MOONCAKE_BURST_S = 3.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help=f"a trace: {', '.join(TRACES)}, or a .jsonl (Mooncake) / "
                                     ".csv (Azure) file")
    src.add_argument("--record", help="pd-router's traffic record (traffic_record: in its config)")
    p.add_argument("--model", help="the model's records and calibration (when they hold several)")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-tpot-ms", type=float, required=True)
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"the router's policy preset (default {DEFAULT_POLICY}); one of "
                        f"{', '.join(sorted(POLICIES))}")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--instances", type=int, help="budget: the best split of this many instances")
    size.add_argument("--target-rate", type=float,
                      help="req/s: the fewest instances (and split) that serve it within the SLOs")
    p.add_argument("--max-instances", type=int, default=128, help="with --target-rate (default 128)")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE,
                   help=f"engine model preset when no --calibration (default {DEFAULT_HARDWARE}); "
                        f"one of {', '.join(PRESETS)}")
    p.add_argument("--calibration", help="GET /admin/calibration's answer saved as JSON: the "
                                         "router's fitted latency models instead of a preset")
    p.add_argument("--kv-capacity-tokens", type=int,
                   help="KV tokens per instance (with --calibration: vLLM logs it at start)")
    p.add_argument("--host-kv-gb", type=float, default=0.0,
                   help="host memory per instance for KV copies (vLLM CPU offloading, LMCache's "
                        "CPU backend): prefixes evicted from the GPU load from it instead of being "
                        "recomputed (default 0: none)")
    p.add_argument("--rates", help="request rates to search, comma-separated (default: a "
                                   "geometric grid around Dynamo's estimate of the capacity)")
    p.add_argument("--start", type=float, default=0.0, help="skip the first S seconds of traffic")
    p.add_argument("--duration", type=float, help="replay only S seconds of traffic")
    p.add_argument("--sample", type=int, help="replay only the first N requests (after --start)")
    p.add_argument("--spread-bursts", type=float,
                   help="spread requests sharing a timestamp over S seconds (default: 3 for "
                        "Mooncake traces, else none)")
    p.add_argument("--full-curves", action="store_true",
                   help="simulate every split at every rate (whole curves; several times slower)")
    p.add_argument("--jobs", type=int, default=1,
                   help="processes that simulate splits in parallel (default 1)")
    p.add_argument("--plot", help="write the plot to this PNG (needs matplotlib)")
    p.add_argument("--json", help="write the plan and every simulated point to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    try:
        from pd_plugins.planner import live
    except ImportError:  # written beside this module (issue 27); planning works without it
        live = None
    if live is not None:
        live.add_apply_arguments(p)
    return p


def load_requests(args: argparse.Namespace) -> list:
    if args.record:
        requests = load_traffic_record(args.record, model=args.model)
        spread = args.spread_bursts
    else:
        requests = load_trace(args.trace)
        mooncake = args.trace == "mooncake_conv" or str(args.trace).endswith(".jsonl")
        spread = args.spread_bursts if args.spread_bursts is not None else (
            MOONCAKE_BURST_S if mooncake else None)
    if spread:
        requests = spread_bursts(requests, spread)
    if args.start or args.duration is not None:
        requests = slice_window(requests, args.start, args.duration if args.duration is not None
                                else float("inf"))
    if args.sample is not None:
        requests = first_n(requests, args.sample)
    return requests


def sim_base(args: argparse.Namespace, block_tokens: int) -> SimConfig:
    return sim_config(hardware=args.hardware, calibration=args.calibration, model=args.model,
                      kv_capacity_tokens=args.kv_capacity_tokens, block_tokens=block_tokens,
                      host_kv_gb=args.host_kv_gb)


def summary(plan: SplitPlan, source: str, n_requests: int) -> str:
    best = plan.best_curve()
    lines = [f"pd-planner: {n_requests} requests from {source}, policy {plan.policy}, SLOs {plan.slo}; "
             f"{plan.simulations} simulations in {plan.wall_s:.1f} s"]
    if plan.mode == "goodput":
        lines.append(f"best split of {plan.instances} instances: {plan.best} "
                     f"(goodput {best.goodput:.3g} req/s: >= 90% of requests within the SLOs)")
        rates = plan.rates()
        if not best.goodput:
            lines.append(f"no split serves 90% of requests within the SLOs even at {rates[0]:.3g} "
                         "req/s: the SLOs may be out of this hardware's reach (or pass --rates)")
        elif all(a >= 0.9 for a in best.attainment.values()) and best.goodput >= rates[-1]:
            lines.append(f"(at least: {plan.best} still met the target at the highest rate searched)")
        if plan.dynamo is not None:
            d = next(c for c in plan.curve if c.split == plan.dynamo)
            dg = f"{d.goodput:.3g} req/s" if d.goodput is not None else f"< {d.below:.3g} req/s"
            lines.append(f"Dynamo's rule (mean ISL/OSL, no KV reuse) would split {plan.dynamo}: "
                         f"goodput {dg}")
    else:
        lines.append(f"fewest instances for {plan.target_rate:g} req/s: {plan.instances}, split "
                     f"{plan.best} (attainment {best.attainment[plan.target_rate]:.3f})")
        lines.append("instances tried (best attainment): "
                     + ", ".join(f"{n}: {a:.3f}" for n, a in plan.tried.items()))
        if plan.dynamo is not None:
            lines.append(f"Dynamo's rule (mean ISL/OSL, no KV reuse) would deploy {plan.dynamo} "
                         f"({plan.dynamo.instances} instances)")
    return "\n".join(lines)


def parse_rates(parser: argparse.ArgumentParser, text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        parser.error(f"--rates must be comma-separated numbers (req/s), got {text!r}")
    for rate in rates:
        if not (math.isfinite(rate) and rate > 0):
            parser.error(f"--rates must be finite and > 0 req/s, got {rate:g}")
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # before anything runs: a SLO of 0, NaN or inf would score every split alike
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        if not (math.isfinite(value) and value > 0):
            parser.error(f"{flag} must be a finite number > 0, got {value:g}")
    if getattr(args, "apply", None):
        from pd_plugins.planner import live
        return live.run_apply(args)
    if args.instances is None and args.target_rate is None:
        parser.error("give --instances (a budget) or --target-rate")
    if args.target_rate is not None and not (math.isfinite(args.target_rate) and args.target_rate > 0):
        parser.error(f"--target-rate must be a finite number > 0, got {args.target_rate:g}")
    # a split is at least 1P:1D, so 2 instances (the search for --target-rate starts at 2)
    for flag, value, low in (("--sample", args.sample, 2), ("--jobs", args.jobs, 1),
                             ("--instances", args.instances, 2),
                             ("--max-instances", args.max_instances, 2),
                             ("--duration", args.duration, 1e-9), ("--start", args.start, 0)):
        if value is not None and not value >= low:  # not >=: NaN too
            parser.error(f"{flag} must be at least {low:g}, got {value:g}")
    rates = parse_rates(parser, args.rates)
    try:
        requests = load_requests(args)
        if len(requests) < 2:
            parser.error(f"{len(requests)} request(s) to replay: widen --duration / --sample")
        progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
        plan = plan_split(requests, slo=Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3),
                          policy=args.policy, instances=args.instances, target_rate=args.target_rate,
                          sim_base=sim_base(args, requests[0].block_tokens), progress=progress,
                          rates=rates, jobs=args.jobs, full_curves=args.full_curves,
                          max_instances=args.max_instances)
    except (OSError, ValueError, ConfigError) as e:
        print(f"pd-planner: {e}", file=sys.stderr)
        return 2
    print(summary(plan, args.record or args.trace, len(requests)))
    print()
    print(format_table(plan))
    # the plan is printed already: a file that cannot be written is reported, not a traceback
    failed = False
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(plan.to_json(), indent=1))
        except OSError as e:
            print(f"pd-planner: --json {args.json}: {e}", file=sys.stderr)
            failed = True
    if args.plot:
        from pd_plugins.planner.plot import write_plot
        try:
            print(f"plot: {write_plot(plan, args.plot)}")
        except (RuntimeError, OSError, ValueError) as e:  # ValueError: a format matplotlib lacks
            print(f"pd-planner: --plot {args.plot}: {e}", file=sys.stderr)
            failed = True
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
