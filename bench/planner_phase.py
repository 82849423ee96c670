"""One phase alone (simulator): where Dynamo's sizing rule and LivePlanner part ways.

The planner benchmark (bench/planner.py) finds Dynamo's rule within 1-2% of the best any strategy
serves on its mix, so its 1.1x target has no room there. This study looks for the room: one
stationary phase, PHASE_S long, run through the same code (bench/planner.py's `run`: the same
hardware, instances, SLOs, policy, interval, window and hysteresis) as every static split, as
Dynamo's rule every window and as LivePlanner, per seed and rate. The phase: the Mooncake
conversation trace's requests with answers of at least 400 tokens (40% of the trace; prompts of
12.5k tokens on average, answers of 560), with the trace's own arrival pattern. Requests count
alike here (one trace), unlike in the mix, where this kind of request is a few percent of them.

    .venv/bin/python -m bench.planner_phase      # ~2 min on two cores

Writes bench/results/planner_phase.json and the "Planner: one phase alone" section of
docs/benchmarks.md (the reading under it is written by hand).
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from bench import common, planner

PHASE = ("mooncake_long_answers", None)  # (trace, x its mean rate: RATES)
RATES = (1.5, 2.0)
SEEDS = (0, 1, 2)
RESULTS = common.RESULTS / "planner_phase.json"
STRATEGIES = ("static", "dynamo", "live")


def jobs() -> list[tuple]:
    todo = []
    for seed in SEEDS:
        for rate in RATES:
            phases = ((PHASE[0], rate),)
            todo += [("static", p, seed, 1.0, phases) for p in range(1, planner.INSTANCES)]
            todo += [(k, planner.INSTANCES // 2, seed, 1.0, phases) for k in ("dynamo", "live")]
    return todo


def study(workers: int = 2) -> dict:
    todo, runs, started = jobs(), [], time.monotonic()
    with ProcessPoolExecutor(workers) as pool:
        for i, (job, out) in enumerate(zip(todo, pool.map(planner.run, todo)), 1):
            runs.append({"strategy": out["strategy"], "prefill": out["prefill"], "seed": out["seed"],
                         "rate": job[4][0][1], "attainment": out["attainment"],
                         "requests": out["requests"], "moves": out["moves"],
                         "split_log": out["split_log"]})
            print(f"[{i}/{len(todo)} {time.monotonic() - started:.0f} s] {out['strategy']} "
                  f"P={out['prefill']} seed {out['seed']} x{job[4][0][1]}: attainment "
                  f"{out['attainment']:.3f}, {out['moves']} moves", flush=True)
    return {"runs": runs, "meta": {"phase": PHASE[0], "rates": RATES, "seeds": SEEDS,
                                   "hardware": planner.HARDWARE, "instances": planner.INSTANCES,
                                   "phase_s": planner.PHASE_S, "machine": common.machine(),
                                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                   "wall_s": time.monotonic() - started}}


def markdown(results: dict) -> str:
    meta, runs = results["meta"], results["runs"]
    slo = planner.SLO
    lines = ["<!-- planner-phase:start -->", "## Planner: one phase alone (where Dynamo's rule misses)", "",
             f"`.venv/bin/python -m bench.planner_phase` (simulator; {meta['date']}; {meta['machine']}; "
             f"{meta['wall_s'] / 60:.0f} min). One stationary phase of {meta['phase_s']:g} s: the "
             "Mooncake conversation trace's requests with answers of at least 400 tokens (40% of the "
             "trace: prompts of 12.5k tokens on average, answers of 560), at the rates below (x that "
             f"subset's mean rate), {meta['instances']} instances of {meta['hardware']}, policy "
             f"`{planner.POLICY}`, SLOs TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s * 1e3:g} ms; "
             "the same code, interval, window and hysteresis as the planner benchmark above. Both "
             "dynamic strategies start at 4P:4D. SLO attainment of the phase's requests:", "",
             "| seed | rate | requests | best static split | Dynamo's rule every window (moves) "
             "| LivePlanner (moves) | LivePlanner / Dynamo's rule | LivePlanner / best static |",
             "|---:|---:|---:|---|---:|---:|---:|---:|"]
    vs_dynamo, vs_static = [], []
    for seed in meta["seeds"]:
        for rate in meta["rates"]:
            cell = [r for r in runs if r["seed"] == seed and r["rate"] == rate]
            static = max((r for r in cell if r["strategy"] == "static"), key=lambda r: r["attainment"])
            dyn = next(r for r in cell if r["strategy"] == "dynamo")
            live = next(r for r in cell if r["strategy"] == "live")
            a, b = live["attainment"] / max(dyn["attainment"], 1e-9), live["attainment"] / static["attainment"]
            vs_dynamo.append(a)
            vs_static.append(b)
            lines.append(f"| {seed} | x{rate:g} | {live['requests']} | {static['prefill']}P:"
                         f"{meta['instances'] - static['prefill']}D {static['attainment']:.3f} | "
                         f"{dyn['attainment']:.3f} ({dyn['moves']}) | {live['attainment']:.3f} "
                         f"({live['moves']}) | {a:.2f}x | {b:.2f}x |")
    lines += ["", f"Median over the cells: LivePlanner / Dynamo's rule {statistics.median(vs_dynamo):.2f}x "
                  f"({min(vs_dynamo):.2f}-{max(vs_dynamo):.2f}); LivePlanner / best static split "
                  f"{statistics.median(vs_static):.2f}x ({min(vs_static):.2f}-{max(vs_static):.2f}).",
              "", "<!-- planner-phase:end -->"]
    return "\n".join(lines) + "\n"


def main() -> int:
    results = study()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    common.write_section("planner-phase", markdown(results))
    print(f"wrote {RESULTS} and docs/benchmarks.md (section planner-phase)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
