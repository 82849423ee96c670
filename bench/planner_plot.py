"""Plot for bench/planner.py; runs in bench/.venv-peers (matplotlib lives there).

    bench/.venv-peers/bin/python bench/planner_plot.py RESULTS.json OUT.png

Top: SLO attainment per control interval at the nominal rate, for the best static split, Dynamo's
rule and LivePlanner (mean over repeats, the band their min..max); bottom: the prefill instances
each strategy had over time (first repeat), the phases shaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"static": ("best static split", "#7f7f7f"), "dynamo": ("Dynamo's rule", "#1f77b4"),
         "live": ("LivePlanner", "#d62728")}


def main(results_path: str, out: str) -> None:
    results = json.loads(Path(results_path).read_text())
    meta, runs, best = results["meta"], results["runs"], results["best_static"]
    step, bounds = meta["interval_s"], meta["bounds"]  # each phase's (start, end): render() writes it
    fig, (att, split) = plt.subplots(2, 1, figsize=(11, 7), sharex=True,
                                     gridspec_kw={"height_ratios": [2, 1]})
    for ax in (att, split):
        for k, ((name, _), (start, stop)) in enumerate(zip(meta["phases"], bounds)):
            ax.axvspan(start, stop, color="#f2f2f2" if k % 2 else "white", zorder=0)
            if ax is att:
                ax.text(start + 5, 0.02, name, fontsize=9, color="#555555")
    for strategy, (label, color) in STYLE.items():
        series = []
        for seed in meta["seeds"]:
            run = next(r for r in runs if r["seed"] == seed and r["scale"] == 1.0
                       and r["strategy"] == strategy
                       and (strategy != "static" or r["prefill"] == best[str(seed)]))
            series.append(run["window_attainment"])
            if seed == meta["seeds"][0]:
                log = run["split_log"] + [[len(run["window_attainment"]) * step, *run["split_log"][-1][1:]]]
                split.step([t for t, _, _ in log], [p for _, p, _ in log], where="post",
                           color=color, label=label)
        n = min(len(s) for s in series)
        xs = [(i + 0.5) * step for i in range(n)]
        cols = [[s[i] for s in series if s[i] is not None] for i in range(n)]
        keep = [i for i in range(n) if cols[i]]
        mean = [sum(cols[i]) / len(cols[i]) for i in keep]
        att.plot([xs[i] for i in keep], mean, color=color, label=label)
        if len(series) > 1:
            att.fill_between([xs[i] for i in keep], [min(cols[i]) for i in keep],
                             [max(cols[i]) for i in keep], color=color, alpha=0.15)
    att.axhline(0.9, color="black", lw=0.6, ls=":")
    att.set_ylabel("SLO attainment per interval")
    att.set_ylim(0, 1.05)
    att.legend(loc="lower right")
    att.set_title(f"{meta['instances']} instances of {meta['hardware']}, SLOs TTFT <= "
                  f"{meta['slo']['ttft_s']:g} s, TPOT <= {meta['slo']['tpot_s'] * 1e3:g} ms")
    split.set_ylabel("prefill instances")
    split.set_xlabel("time (s)")
    split.set_ylim(0, meta["instances"])
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
