"""Plot for bench/planner_replay.py; runs in bench/.venv-peers (matplotlib lives there).

    bench/.venv-peers/bin/python bench/planner_replay_plot.py RESULTS.json OUT.png

Top: SLO attainment per control interval over HTTP (median over the replays, the band their
min..max) and the simulator's prediction of the same run (dashed), for the best static split,
Dynamo's rule and LivePlanner; bottom: the prefill instances each strategy had over time (the
first replay, as the planner process read it from the router; the simulator's dashed), the
phases shaded.
"""

from __future__ import annotations

import json
from statistics import median
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"static": ("best static split", "#7f7f7f"), "dynamo": ("Dynamo's rule", "#1f77b4"),
         "live": ("LivePlanner", "#d62728")}


def main(results_path: str, out: str) -> None:
    results = json.loads(Path(results_path).read_text())
    meta, sims, reps = results["meta"], results["sim"], results["replay"]
    n, step = meta["instances"], meta["interval_s"]
    keys = {"static": meta["best_replayed_static"], "dynamo": f"dynamo {n // 2}", "live": f"live {n // 2}"}
    fig, (att, split) = plt.subplots(2, 1, figsize=(11, 7), sharex=True,
                                     gridspec_kw={"height_ratios": [2, 1]})
    end = meta["span_s"]
    bounds = meta["bounds"]  # each phase's (start, end): render() writes it
    for ax in (att, split):
        for k, ((name, _), (start, stop)) in enumerate(zip(meta["phases"], bounds)):
            ax.axvspan(start, stop, color="#f2f2f2" if k % 2 else "white", zorder=0)
            if ax is split:
                ax.text(start + 1, n - 0.4, name, fontsize=9, color="#555555")
    for strategy, (label, color) in STYLE.items():
        key = keys[strategy]
        series = [r["window_attainment"] for r in reps[key]]
        cols = [[s[i] for s in series if s[i] is not None] for i in range(min(map(len, series)))]
        keep = [i for i, c in enumerate(cols) if c]
        xs = [(i + 0.5) * step for i in keep]
        if strategy == "static":
            label += f" ({key.split()[1]}P:{n - int(key.split()[1])}D)"
        att.plot(xs, [median(cols[i]) for i in keep], color=color, label=f"{label}, replay")
        if len(series) > 1:
            att.fill_between(xs, [min(cols[i]) for i in keep], [max(cols[i]) for i in keep],
                             color=color, alpha=0.15)
        sim = sims[key]["window_attainment"]
        sim_keep = [i for i, v in enumerate(sim) if v is not None]
        att.plot([(i + 0.5) * step for i in sim_keep], [sim[i] for i in sim_keep], color=color,
                 ls="--", lw=1, label=f"{label}, simulator")
        for log, ls in ((reps[key][0]["split_log"], "-"), (sims[key]["split_log"], "--")):
            log = log + [[max(end, log[-1][0]), *log[-1][1:]]]
            split.step([t for t, _, _ in log], [p for _, p, _ in log], where="post", color=color,
                       ls=ls, lw=1.5 if ls == "-" else 1)
    att.axhline(0.9, color="black", lw=0.6, ls=":")
    att.set_ylabel("SLO attainment per interval")
    att.set_ylim(0, 1.05)
    att.legend(loc="lower left", fontsize=8, ncol=3)
    att.set_title(f"Over HTTP: pd-router + {n} kv_both mocks ({meta['hardware']}), SLOs TTFT <= "
                  f"{meta['slo']['ttft_s']:g} s, TPOT <= {meta['slo']['tpot_s'] * 1e3:g} ms")
    split.set_ylabel("prefill instances")
    split.set_xlabel("time (model s)")
    split.set_ylim(0, n)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
