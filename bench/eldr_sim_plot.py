"""Plot for bench/eldr_sim.py; runs in bench/.venv-peers (matplotlib lives there).

    bench/.venv-peers/bin/python bench/eldr_sim_plot.py RESULTS.json OUT_DIR

OUT_DIR/eldr_sim.png: TPOT p50 and p99 per policy, per (workload, decode workers, rate), median
over the workload's seeds with min-max bars.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

POLICIES = ("round_robin", "least_loaded", "eldr", "eldr_strict")
COLORS = {"round_robin": "#7f7f7f", "least_loaded": "#1f77b4", "eldr": "black",
          "eldr_strict": "#d62728"}


def main(results_path: str, out_dir: str) -> None:
    runs = json.loads(Path(results_path).read_text())["runs"]
    for r in runs:
        r.setdefault("workload", "synthetic")  # results from before the captured workload
    groups = sorted({(r["workload"], r["decodes"], r["scale"]) for r in runs},
                    key=lambda g: (g[0] != "synthetic", g[1], g[2]))
    fig, axes = plt.subplots(2, 1, figsize=(12, 8))
    width = 0.8 / len(POLICIES)
    for ax, key, title in ((axes[0], "tpot_p50", "TPOT p50"), (axes[1], "tpot_p99", "TPOT p99")):
        for j, policy in enumerate(POLICIES):
            meds, lows, highs = [], [], []
            for g in groups:
                values = [r[key] * 1e3 for r in runs
                          if (r["workload"], r["decodes"], r["scale"]) == g
                          and r["policy"] == policy]
                med = statistics.median(values)
                meds.append(med)
                lows.append(med - min(values))
                highs.append(max(values) - med)
            xs = [i + (j - (len(POLICIES) - 1) / 2) * width for i in range(len(groups))]
            ax.bar(xs, meds, width, yerr=[lows, highs], capsize=2, label=policy,
                   color=COLORS[policy])
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{w}\n{d} decode, x{s:g} rate" for w, d, s in groups], fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Decode routing with expert locality (simulator, Qwen3-30B-A3B on H200)")
    fig.tight_layout()
    fig.savefig(Path(out_dir) / "eldr_sim.png", dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
