"""Routing quality in the cluster simulator: the peers' rules and ours, on real traces, over a
sweep of request rates, in one harness (pd_plugins/perf/cluster_sim.py runs the router's own
scheduler over modelled engines).

    .venv/bin/python -m bench.routing_sim            # the full study, ~15 minutes on 2 cores
    .venv/bin/python -m bench.routing_sim --quick    # 3 rates, first 3000 requests: ~1 minute
    .venv/bin/python -m bench.routing_sim --render   # tables and plots again from the last results

Writes bench/results/routing_sim.json, docs/img/routing_<trace>.png and the "Routing quality"
section of docs/benchmarks.md. The simulator is deterministic (no run-to-run spread to report);
what varies is the model, so the model, cluster and SLOs are stated with every figure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict

from tqdm import tqdm

from bench import common
from pd_plugins.perf.cluster_sim import SimConfig, simulate
from pd_plugins.perf.hardware import preset as hardware_preset
from pd_plugins.perf.report import Slo, cdf, goodput, summarize
from pd_plugins.routers.config import PolicySpec
from pd_plugins.routers.policy.scheduler import DEFAULT_POLICY, PEER_PRESETS, PREFIX_SOURCE, preset
from pd_plugins.workloads import load_trace, scale_time, spread_bursts
from pd_plugins.workloads.trace import summary as trace_summary

# Ours: the headline's, the multi-turn one (it tracks sessions; prefix detection finds them in
# these traces too) and the router's default, which should be within 5% of the best of ours.
HEADLINE = "goodput"
OURS = (HEADLINE, "multi_turn", DEFAULT_POLICY)
DEFAULT_TARGET = 0.95  # the default's goodput against the best of ours
POLICIES = (*PEER_PRESETS, *OURS)
HARDWARE = "llama-3.1-8b@h100"
CLUSTER = (8, 8)  # prefill, decode instances
# DistServe-style fixed SLOs per workload: Mooncake's prompts average 12k tokens (up to 126k), so
# its TTFT SLO is looser than the Azure chat trace's.
SLOS = {"mooncake_conv": Slo(ttft_s=5.0, tpot_s=0.05), "azure_conv": Slo(ttft_s=2.0, tpot_s=0.05)}
# Our presets reject at this share of the TTFT SLO (headroom for the estimate's error); peers with
# early rejection (mooncake) reject at the SLO itself, as published.
OUR_ADMISSION_HEADROOM = 0.75
# Time-scale factors per trace (x the trace's own request rate), chosen to cross saturation.
SCALES = {"mooncake_conv": (1, 2, 3, 4, 5, 6, 7, 8, 10, 12),
          "azure_conv": (8, 16, 24, 28, 32, 36, 40, 48, 56)}
# Mooncake's timestamps come in 3 s batches: spread each batch over its 3 s (workloads.spread_bursts).
BURST_WINDOW_S = {"mooncake_conv": 3.0}
QUICK_SCALES = {"mooncake_conv": (2, 5, 8), "azure_conv": (16, 32, 48)}
RESULTS = common.RESULTS / "routing_sim.json"


def policy_for(name: str, slo: Slo) -> PolicySpec:
    """The preset, with its early-rejection thresholds set to the study's SLOs."""
    spec = preset(name)
    if spec.admission is not None:
        params = dict(spec.admission.params)
        params["ttft_slo_ms"] = slo.ttft_s * 1e3 * (OUR_ADMISSION_HEADROOM if name in OURS else 1.0)
        if "tpot_slo_ms" in params:
            params["tpot_slo_ms"] = slo.tpot_s * 1e3
        spec.admission.params = params
    return spec


def workload(trace: str, limit: int | None) -> list:
    requests = load_trace(trace)
    if trace in BURST_WINDOW_S:
        requests = spread_bursts(requests, BURST_WINDOW_S[trace])
    return requests[:limit] if limit else requests


def run_one(trace: str, policy: str, scale: float, limit: int | None) -> dict:
    requests = workload(trace, limit)
    requests = scale_time(requests, scale)
    config = SimConfig(hardware_preset(HARDWARE), *CLUSTER, policy=policy_for(policy, SLOS[trace]),
                       prefix_source=PREFIX_SOURCE.get(policy, "events"))
    started = time.process_time()
    result = simulate(requests, config)
    span = max(r.arrival_s for r in requests) or 1.0
    out = summarize(result.outcomes, SLOS[trace], result.sim_span_s, cached_tokens=result.prompt_tokens_cached,
                    computed_tokens=result.prefill_tokens_computed, kv_bytes_moved=result.kv_bytes_moved)
    served = [o for o in result.outcomes if o.status == "ok"]
    out.update(trace=trace, policy=policy, scale=scale, rate=len(requests) / span,
               cpu_s=time.process_time() - started,
               ttft_cdf=cdf([o.ttft_s for o in served]),
               tpot_cdf=cdf([o.tpot_s for o in served if o.tpot_s is not None]))
    return out


def study(quick: bool) -> dict:
    scales = QUICK_SCALES if quick else SCALES
    limit = 3000 if quick else None
    jobs = [(t, p, s) for t in scales for p in POLICIES for s in scales[t]]
    runs = []
    with ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(run_one, t, p, s, limit) for t, p, s in jobs]
        for f in tqdm(as_completed(futures), total=len(futures), desc="simulations", unit="run"):
            runs.append(f.result())
    traces = {}
    for t in scales:
        traces[t] = trace_summary(workload(t, limit))
    return {"meta": {"date": dt.date.today().isoformat(), "machine": common.machine(),
                     "hardware": HARDWARE, "cluster": CLUSTER, "quick": quick,
                     "slo": {t: asdict(SLOS[t]) for t in scales}, "admission_headroom": OUR_ADMISSION_HEADROOM,
                     "limit": limit, "policies": POLICIES, "ours": HEADLINE, "ours_all": OURS,
                     "default": DEFAULT_POLICY,
                     "prefix_source": {p: PREFIX_SOURCE.get(p, "events") for p in POLICIES}},
            "traces": traces, "runs": runs}


# -- reading the results ---------------------------------------------------------------------
def by_policy(results: dict, trace: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in results["runs"]:
        if r["trace"] == trace:
            out.setdefault(r["policy"], []).append(r)
    for runs in out.values():
        runs.sort(key=lambda r: r["rate"])
    return out


def policy_goodput(runs: list[dict]) -> float:
    return goodput([r["rate"] for r in runs], [r["slo_attainment"] for r in runs])


def ours_all(meta: dict) -> tuple[str, ...]:
    return tuple(meta.get("ours_all", (meta["ours"],)))  # results written before the default ran


def headline(results: dict, trace: str) -> dict:
    """Ours against the best peer: goodput ratio, and mean TTFT at the best peer's goodput rate."""
    pols = by_policy(results, trace)
    ours = results["meta"]["ours"]
    peers = {p: policy_goodput(r) for p, r in pols.items() if p not in ours_all(results["meta"])}
    best = max(peers, key=peers.get)
    # the highest swept rate the best peer still serves within SLO (else its lowest rate)
    ok = [r["rate"] for r in pols[best] if r["slo_attainment"] >= 0.9] or [pols[best][0]["rate"]]
    at = max(ok)
    ttft = {p: next(r["ttft_s"]["mean"] for r in pols[p] if r["rate"] == at) for p in (best, ours)}
    return {"best_peer": best, "best_peer_goodput": peers[best], "ours_goodput": policy_goodput(pols[ours]),
            "goodput_ratio": policy_goodput(pols[ours]) / peers[best] if peers[best] else None,
            "at_rate": at, "ttft_best_peer": ttft[best], "ttft_ours": ttft[ours],
            "ttft_ratio": ttft[ours] / ttft[best] if ttft[best] else None}


def best_of_ours(results: dict, trace: str) -> tuple[str, float]:
    pols = by_policy(results, trace)
    goodputs = {p: policy_goodput(pols[p]) for p in ours_all(results["meta"]) if p in pols}
    best = max(goodputs, key=goodputs.get)
    return best, goodputs[best]


def default_line(results: dict, trace: str) -> str:
    """The router's default against the best of ours on this trace (target: within 5%)."""
    default = results["meta"].get("default")
    pols = by_policy(results, trace)
    if default not in pols:
        return ""
    best, best_goodput = best_of_ours(results, trace)
    mine = policy_goodput(pols[default])
    ratio = mine / best_goodput if best_goodput else None
    met = ratio is not None and ratio >= DEFAULT_TARGET
    return (f"**Default** (`{default}`, pd-router's default policy): goodput {fmt(mine)} req/s vs the "
            f"best of ours (`{best}`) {fmt(best_goodput)} req/s: **{fmt(ratio)}x** "
            f"(target >= {DEFAULT_TARGET:g}x: {'met' if met else 'missed'}).")


def fmt(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(results: dict) -> str:
    meta = results["meta"]
    hw = hardware_preset(meta["hardware"])
    lines = ["<!-- routing-sim:start -->", "## Routing quality (cluster simulator)", "",
             f"Written by `bench/routing_sim.py{' --quick' if meta['quick'] else ''}` on {meta['date']} "
             f"({meta['machine']}). Rerun: `make bench-routing` (about 15 minutes).", "",
             f"- **Cluster**: {meta['cluster'][0]} prefill + {meta['cluster'][1]} decode instances of "
             f"{hw.name} (roofline model, docs/simulation.md: MFU {hw.mfu}, MBU {hw.mbu}, "
             f"{hw.kv_capacity_tokens():,} KV tokens per instance, KV link "
             f"{hw.link_bytes_per_s / 1e9:g} GB/s), vLLM pull flow, 512-token prefix blocks.",
             "- **SLOs** (per trace, below): attainment counts rejected requests as misses; goodput "
             "is the highest request rate with attainment >= 90% (DistServe), interpolated between "
             "swept rates. Policies that reject early are given the same SLOs (ours reject at "
             f"{meta['admission_headroom']:.0%} of the TTFT SLO, headroom for its estimate's error).",
             "- **Policies**: the peers' published rules re-implemented as pd-router presets "
             "(pd_plugins/routers/policy/peers.py cites each source), each with its own prefix "
             "knowledge (" + ", ".join(f"{p}: {s}" for p, s in meta["prefix_source"].items()) + "), "
             "and ours, " + ", ".join(f"`{p}`" for p in ours_all(meta))
             + (f" (`{meta['default']}` is pd-router's default policy)" if meta.get("default") else "")
             + ". Every policy runs unchanged in the router; the simulator "
             "calls the same scheduler and accounting code.",
             "- The simulator is deterministic: the same trace, rate and policy give the same "
             "numbers, so there is no run-to-run spread; the uncertainty is the model's "
             "(see \"Simulator and replay agree\" below for a check against the HTTP path).", ""]
    for trace, info in results["traces"].items():
        pols = by_policy(results, trace)
        h = headline(results, trace)
        vs_default = default_line(results, trace)
        lines += [f"### {trace}", "",
                  f"{info['count']:,} requests, mean input {info['input_mean']:,.0f} tokens, mean "
                  f"output {info['output_mean']:,.0f}, {info['rate_per_s']:.2f} req/s at 1x; "
                  f"prefix-cacheable share {info.get('full_block_cacheable_share', 0):.0%}. "
                  f"SLOs: {Slo(**meta['slo'][trace])}."
                  + (f" Requests recorded in one timestamp batch are spread over its "
                     f"{BURST_WINDOW_S[trace]:g} s." if trace in BURST_WINDOW_S else ""), "",
                  f"**Headline**: `{meta['ours']}` goodput {fmt(h['ours_goodput'])} req/s vs the best "
                  f"peer (`{h['best_peer']}`) {fmt(h['best_peer_goodput'])} req/s: "
                  f"**{fmt(h['goodput_ratio'])}x** (target >= 1.25x). Mean TTFT at "
                  f"{h['at_rate']:.1f} req/s: {fmt(h['ttft_ours'], 3)} s vs {fmt(h['ttft_best_peer'], 3)} s: "
                  f"**{fmt(h['ttft_ratio'])}x** (target <= 0.8x; served requests only).", "",
                  *([vs_default, ""] if vs_default else []),
                  "| policy | goodput (req/s) | vs best peer | vs best of ours | attainment by rate | "
                  "rejected at max rate | cache hit (mid rate) | mean TTFT (mid rate) | p99 TTFT (mid rate) "
                  "| p50 TPOT (mid rate) |",
                  "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
        _, best_ours = best_of_ours(results, trace)
        for policy in meta["policies"]:
            runs = pols.get(policy)
            if not runs:
                continue
            mid = runs[len(runs) // 2]
            g = policy_goodput(runs)
            ratio = g / h["best_peer_goodput"] if h["best_peer_goodput"] else None
            to_ours = f"{fmt(g / best_ours)}x" if best_ours and policy in ours_all(meta) else ""
            curve = " ".join(f"{r['slo_attainment']:.2f}" for r in runs)
            name = (f"**{policy}** (ours, default)" if policy == meta.get("default")
                    else f"**{policy}** (ours)" if policy in ours_all(meta) else policy)
            lines.append(f"| {name} | {fmt(g)} | {fmt(ratio)}x | {to_ours} | {curve} | "
                         f"{runs[-1]['rejected']:,} | "
                         f"{fmt(mid['cache_hit_rate'])} | {fmt(mid['ttft_s']['mean'], 3)} | "
                         f"{fmt(mid['ttft_s']['p99'], 3)} | {fmt((mid['tpot_s']['p50'] or 0) * 1e3, 1)} ms |")
        rates = ", ".join(f"{r['rate']:.1f}" for r in pols[meta["ours"]])
        lines += ["", f"Rates swept (req/s): {rates}; \"mid rate\" is the middle one "
                      f"({pols[meta['ours']][len(pols[meta['ours']]) // 2]['rate']:.1f} req/s).", "",
                  f"![{trace}](img/routing_{trace}.png)", ""]
    cpu = sum(r["cpu_s"] for r in results["runs"])
    slowest = max(results["runs"], key=lambda r: r["cpu_s"])
    lines += [f"{len(results['runs'])} simulations, {cpu / 60:.1f} CPU-minutes in all; the slowest "
              f"({slowest['policy']} on {slowest['trace']} at {slowest['rate']:.1f} req/s, "
              f"{results['traces'][slowest['trace']]['count']:,} requests on "
              f"{sum(meta['cluster'])} instances) took {slowest['cpu_s']:.0f} s of one core.",
              "<!-- routing-sim:end -->"]
    return "\n".join(lines) + "\n"


def render() -> int:
    results = json.loads(RESULTS.read_text())
    results["goodput"] = {t: {p: policy_goodput(runs) for p, runs in by_policy(results, t).items()}
                          for t in results["traces"]}
    RESULTS.write_text(json.dumps(results))  # the plotter reads the goodputs from here
    common.write_section("routing-sim", markdown(results))
    py = common.plot_python()
    if py is not None:
        subprocess.run([str(py), str(common.ROOT / "bench" / "routing_plot.py"), str(RESULTS),
                        str(common.IMG)], check=True)
    print(f"wrote {common.DOC.relative_to(common.ROOT)} and docs/img/routing_*.png")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--render", action="store_true", help="only redo tables and plots")
    args = parser.parse_args()
    if not args.render:
        results = study(args.quick)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results))
    return render()


if __name__ == "__main__":
    sys.exit(main())
