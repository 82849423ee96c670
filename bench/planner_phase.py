"""One phase alone (simulator): where Dynamo's sizing rule and LivePlanner part ways.

The planner benchmark (bench/planner.py) finds Dynamo's rule within 1-2% of the best any strategy
serves on its mix, so its 1.1x target has no room there. This study looks for the room: one
stationary phase, PHASE_S long, run through the same code (bench/planner.py's `run`: the same
hardware, instances, SLOs, policy, interval, window and hysteresis) as every static split, as
Dynamo's rule every window and as LivePlanner, per seed and rate. The phase: the Mooncake
conversation trace's requests with answers of at least 400 tokens (40% of the trace; prompts of
12.5k tokens on average, answers of 560), with the trace's own arrival pattern. Requests count
alike here (one trace), unlike in the mix, where this kind of request is a few percent of them.

    .venv/bin/python -m bench.planner_phase           # ~2 min on two cores
    .venv/bin/python -m bench.planner_phase --render  # the section from the results

Writes bench/results/planner_phase.json and the "Planner: one phase alone" section of
docs/benchmarks.md (the reading under it is written by hand).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor

from bench import common, planner

PHASE = "mooncake_long_answers"  # bench/planner.py's ANSWER_CUTS
RATES = (1.5, 2.0)  # x that trace's mean rate
SEEDS = (0, 1, 2)
RESULTS = common.RESULTS / "planner_phase.json"


def jobs() -> list[tuple]:
    """bench/planner.py's `run` jobs: every static split, Dynamo's rule and LivePlanner."""
    todo = []
    for seed in SEEDS:
        for rate in RATES:
            phases = ((PHASE, rate),)
            todo += [("static", p, seed, 1.0, phases) for p in range(1, planner.INSTANCES)]
            todo += [(k, planner.INSTANCES // 2, seed, 1.0, phases) for k in ("dynamo", "live")]
    return todo


def study(workers: int = 2) -> dict:
    todo, runs, started = jobs(), [], time.monotonic()
    with ProcessPoolExecutor(workers) as pool:
        for i, (job, out) in enumerate(zip(todo, pool.map(planner.run, todo)), 1):
            rate = job[4][0][1]
            runs.append({key: out[key] for key in ("strategy", "prefill", "seed", "attainment",
                                                   "requests", "moves", "split_log")}
                        | {"rate": rate})
            print(f"[{i}/{len(todo)} {time.monotonic() - started:.0f} s] {out['strategy']} "
                  f"P={out['prefill']} seed {out['seed']} x{rate}: attainment "
                  f"{out['attainment']:.3f}, {out['moves']} moves", flush=True)
    meta = {"phase": PHASE, "rates": RATES, "seeds": SEEDS, "hardware": planner.HARDWARE,
            "instances": planner.INSTANCES, "phase_s": planner.PHASE_S,
            "machine": common.machine(), "wall_s": time.monotonic() - started,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    return {"runs": runs, "meta": meta}


def markdown(results: dict) -> str:
    meta, runs = results["meta"], results["runs"]
    slo, n = planner.SLO, meta["instances"]
    lines = [
        "<!-- planner-phase:start -->",
        "## Planner: one phase alone (where Dynamo's rule misses)", "",
        f"`.venv/bin/python -m bench.planner_phase` (simulator; {meta['date']}; "
        f"{meta['machine']}; {meta['wall_s'] / 60:.0f} min). One stationary phase of "
        f"{meta['phase_s']:g} s: the Mooncake conversation trace's requests with answers of at "
        "least 400 tokens (40% of the trace: prompts of 12.5k tokens on average, answers of 560), "
        f"at the rates below (x that subset's mean rate), {n} instances of {meta['hardware']}, "
        f"policy `{planner.POLICY}`, SLOs TTFT <= {slo.ttft_s:g} s, TPOT <= "
        f"{slo.tpot_s * 1e3:g} ms; the same code, interval, window and hysteresis as the planner "
        "benchmark above. Both dynamic strategies start at 4P:4D. SLO attainment of the phase's "
        "requests:", "",
        "| seed | rate | requests | best static split | Dynamo's rule every window (moves) "
        "| LivePlanner (moves) | LivePlanner / Dynamo's rule | LivePlanner / best static |",
        "|---:|---:|---:|---|---:|---:|---:|---:|"]
    vs_dynamo, vs_static = [], []
    for seed in meta["seeds"]:
        for rate in meta["rates"]:
            cell = [r for r in runs if r["seed"] == seed and r["rate"] == rate]
            static = max((r for r in cell if r["strategy"] == "static"),
                         key=lambda r: r["attainment"])
            dyn = next(r for r in cell if r["strategy"] == "dynamo")
            live = next(r for r in cell if r["strategy"] == "live")
            vs_dynamo.append(live["attainment"] / max(dyn["attainment"], 1e-9))
            vs_static.append(live["attainment"] / static["attainment"])
            lines.append(
                f"| {seed} | x{rate:g} | {live['requests']} | {static['prefill']}P:"
                f"{n - static['prefill']}D {static['attainment']:.3f} | {dyn['attainment']:.3f} "
                f"({dyn['moves']}) | {live['attainment']:.3f} ({live['moves']}) | "
                f"{vs_dynamo[-1]:.2f}x | {vs_static[-1]:.2f}x |")

    lines += ["", "Median over the cells: LivePlanner / Dynamo's rule "
                  f"{common.spread(vs_dynamo, '{:.2f}x')}; LivePlanner / best static split "
                  f"{common.spread(vs_static, '{:.2f}x')}.",
              "", "<!-- planner-phase:end -->"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--render", action="store_true",
                        help=f"only redo the section from {RESULTS.name}")
    if not parser.parse_args().render:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(study(), indent=1))
    common.write_section("planner-phase", markdown(json.loads(RESULTS.read_text())))
    print(f"wrote docs/benchmarks.md (section planner-phase) from {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
