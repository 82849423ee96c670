"""Do the two instruments agree? The same Mooncake slice through the cluster simulator and through
the real pd-router in front of latency-modelled mock engines (HTTP on loopback, accelerated clock).

    .venv/bin/python -m bench.sim_vs_replay            # 200 requests, 3 replays: ~3 minutes
    .venv/bin/python -m bench.sim_vs_replay --quick    # 60 requests, 1 replay

Each policy runs once in the simulator (deterministic) and `--repeats` times over HTTP (this
machine is noisy: the table gives the median and the range). Writes bench/results/sim_vs_replay.json
and the "Simulator and replay agree" section of docs/benchmarks.md. The issue's bar: TTFT p50 and
TPOT p50 within 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from bench import common
from pd_plugins.mock.client import collect_engine_stats
from pd_plugins.perf.cluster_sim import SimConfig, simulate
from pd_plugins.perf.hardware import preset as hardware_preset
from pd_plugins.perf.replay import replay
from pd_plugins.perf.report import Slo, summarize
from pd_plugins.testing.router_harness import modelled_deployment
from pd_plugins.workloads import first_n, load_trace, scale_time, spread_bursts

HARDWARE = "llama-3.1-8b@h100"
BLOCK = 512                       # the trace's prefix-block size, for the engines and the router
CLUSTER = tuple(int(x) for x in __import__("os").environ.get("SVR_CLUSTER", "2,2").split(","))
SLO = Slo(ttft_s=5.0, tpot_s=0.05)
POLICIES = ("round_robin", "prefix_cache")  # the second reads the mocks' KV events
SCRAPE_S = 0.25  # the router's engine-metrics interval (wall): short, so its phase matters little
RESULTS = common.RESULTS / "sim_vs_replay.json"
METRICS = (("ttft_s", "p50"), ("tpot_s", "p50"), ("ttft_s", "mean"), ("ttft_s", "p90"), ("e2e_s", "p50"))


def simulated(requests, policy: str, speedup: float) -> dict:
    config = SimConfig(hardware_preset(HARDWARE), *CLUSTER, policy=policy, prefix_source="events",
                       scrape_interval_s=SCRAPE_S * speedup)  # as the router, in model time
    r = simulate(requests, config)
    return summarize(r.outcomes, SLO, r.sim_span_s, cached_tokens=r.prompt_tokens_cached,
                     computed_tokens=r.prefill_tokens_computed, kv_bytes_moved=r.kv_bytes_moved)


def replayed(requests, policy: str, speedup: float, log_dir: str) -> dict:
    with modelled_deployment(HARDWARE, *CLUSTER, policy, speedup=speedup, block_size=BLOCK,
                             scrape_s=SCRAPE_S, log_dir=Path(log_dir)) as (router, engines):
        with tqdm(total=len(requests), desc=f"  {policy} replay", unit="req") as bar:
            result = asyncio.run(replay(router.url, requests, speedup, "mock", timeout_s=600,
                                        progress=lambda done: bar.update(done - bar.n)))
        stats = asyncio.run(collect_engine_stats([e.url for e in engines]))
    out = summarize(result.outcomes, SLO, result.span_s, itl_s=result.itl_s,
                    cached_tokens=stats["cached_tokens"], computed_tokens=stats["computed_tokens"],
                    kv_bytes_moved=stats["kv_bytes_moved"])
    out["max_engine_lag_s"] = max(s.get("max_lag_s", 0) for s in stats["engines"].values())
    out["wall_s"] = result.wall_s
    return out


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = ["<!-- sim-vs-replay:start -->", "## Simulator and replay agree", "",
             f"Written by `bench/sim_vs_replay.py{' --quick' if meta['quick'] else ''}` on "
             f"{meta['date']} ({meta['machine']}), {meta['wall_min']:.1f} min.", "",
             f"The first {meta['requests']} requests of the Mooncake conversation trace (3 s "
             "timestamp batches spread over their 3 s) at "
             f"{meta.get('rate_scale', 1):g}x its rate ({meta['span_s']:.0f} s) on {CLUSTER[0]}P+{CLUSTER[1]}D x {HARDWARE}: "
             "once through the cluster simulator, and "
             f"{meta['repeats']}x through the real `pd-router` in front of `pd-mock-engine "
             f"--latency-model {HARDWARE} --speedup {meta['speedup']:g} --block-size {BLOCK} --kv-events` "
             "(loopback HTTP, streamed, open loop). Replay times are model seconds (wall x speedup). "
             "Bar: TTFT p50 and TPOT p50 within 10%.", "",
             "| policy | metric | simulator | replay median (min-max) | difference |",
             "|---|---|---:|---:|---:|"]
    for policy, r in results["policies"].items():
        for metric, stat in METRICS:
            sim = r["sim"][metric][stat]
            runs = [x[metric][stat] for x in r["replay"]]
            med = statistics.median(runs)
            diff = (med - sim) / sim if sim else None
            scale, unit = (1e3, " ms") if metric == "tpot_s" else (1, " s")
            bold = "**" if stat == "p50" and metric in ("ttft_s", "tpot_s") else ""
            lines.append(f"| {policy} | {bold}{metric[:-2].upper()} {stat}{bold} | {sim * scale:.3f}{unit} | "
                         f"{med * scale:.3f}{unit} ({min(runs) * scale:.3f}-{max(runs) * scale:.3f}) | "
                         f"{bold}{diff:+.1%}{bold} |")
        hit_sim = r["sim"]["cache_hit_rate"]
        hits = [x["cache_hit_rate"] for x in r["replay"]]
        lines.append(f"| {policy} | cache hit rate | {hit_sim:.3f} | {statistics.median(hits):.3f} | "
                     f"{statistics.median(hits) - hit_sim:+.3f} |")
    lags = [x["max_engine_lag_s"] for r in results["policies"].values() for x in r["replay"]]
    lines += ["", "Known differences: the simulator caches at 512-token blocks exactly like the "
              "mocks here, but the replay adds real HTTP, JSON of 12k-token prompts and the client's "
              "own scheduling, each multiplied by the speedup; the router's wall-clock intervals "
              f"(scrapes) scale too. Largest lag of a mock behind its model clock: {max(lags):.3f} s. "
              "A load-aware policy (prefix_cache reads scraped queues and its own in-flight counts) "
              "makes a few different choices whenever the timing differs by a few milliseconds, and "
              "where the TTFT distribution has a gap at its median those few requests move the p50 "
              "across the gap: compare the replays' range, the mean and the p90 too.",
              "<!-- sim-vs-replay:end -->"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--speedup", type=float, default=2.0)
    parser.add_argument("--rate-scale", type=float, default=0.6,
                        help="x the trace's request rate (0.6: loaded, not overloaded, on 2P+2D)")
    parser.add_argument("--render", action="store_true", help="only redo the section from the last results")
    args = parser.parse_args()
    if args.render:
        common.write_section("sim-vs-replay", markdown(json.loads(RESULTS.read_text())))
        return 0
    n = args.requests or (60 if args.quick else 200)
    repeats = args.repeats or (1 if args.quick else 3)
    # The trace's 3 s timestamp batches are spread out, so that the order within a batch is the
    # same in both instruments (workloads.spread_bursts).
    requests = scale_time(first_n(spread_bursts(load_trace("mooncake_conv"), 3.0), n), args.rate_scale)
    started = time.monotonic()
    results = {"meta": {"date": dt.date.today().isoformat(), "machine": common.machine(), "quick": args.quick,
                        "requests": n, "repeats": repeats, "speedup": args.speedup,
                        "rate_scale": args.rate_scale,
                        "span_s": requests[-1].arrival_s}, "policies": {}}
    with tempfile.TemporaryDirectory(prefix="sim-vs-replay-") as log_dir:
        for policy in POLICIES:
            sim = simulated(requests, policy, args.speedup)
            runs = []
            for i in range(repeats):
                print(f"{policy}: replay {i + 1}/{repeats} ({n} requests, ~{requests[-1].arrival_s / args.speedup:.0f} s)",
                      flush=True)
                runs.append(replayed(requests, policy, args.speedup, log_dir))
                print(f"  TTFT p50 sim {sim['ttft_s']['p50']:.3f} s, replay {runs[-1]['ttft_s']['p50']:.3f} s; "
                      f"TPOT p50 sim {sim['tpot_s']['p50'] * 1e3:.2f} ms, replay "
                      f"{runs[-1]['tpot_s']['p50'] * 1e3:.2f} ms", flush=True)
            results["policies"][policy] = {"sim": sim, "replay": runs}
    results["meta"]["wall_min"] = (time.monotonic() - started) / 60
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results))
    common.write_section("sim-vs-replay", markdown(results))
    print(f"wrote {RESULTS.relative_to(common.ROOT)} and docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
