"""Plot for bench/replicas.py; runs in bench/.venv-peers (matplotlib lives there).

    bench/.venv-peers/bin/python bench/replicas_plot.py RESULTS.json OUT_DIR

OUT_DIR/replicas.png: per workload, goodput and turn-2+ TTFT p50 of each setup (bars: median over
the repeats; whiskers: min to max).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"one router": "black", "two replicas, shared": "#2ca02c",
          "two replicas, not shared": "#d62728", "plain PD, one router": "#7f7f7f"}
PANELS = (("goodput_rps", "goodput (req/s, within SLO)", 1.0), ("ttft2_p50", "turn-2+ TTFT p50 (ms)", 1e3))


def main(results_path: str, out_dir: str) -> None:
    results = json.loads(Path(results_path).read_text())
    workloads = list(results["runs"])
    fig, axes = plt.subplots(len(workloads), len(PANELS), figsize=(12, 3.6 * len(workloads)), squeeze=False)
    for row, workload in enumerate(workloads):
        by_setup = results["runs"][workload]
        for col, (key, title, scale) in enumerate(PANELS):
            ax = axes[row][col]
            names, meds, lows, highs = [], [], [], []
            if key == "ttft2_p50" and not any(r.get(key) for runs in by_setup.values() for r in runs):
                title = "TTFT p50 (ms; no later turns in this trace)"
            for setup, runs in by_setup.items():
                vals = [(r[key] if r.get(key) is not None else r["ttft_s"]["p50"]) * scale for r in runs]
                if not vals:
                    continue
                m = statistics.median(vals)
                names.append(setup)
                meds.append(m)
                lows.append(m - min(vals))
                highs.append(max(vals) - m)
            ax.bar(range(len(names)), meds, yerr=[lows, highs], capsize=4,
                   color=[COLORS.get(n, "#1f77b4") for n in names])
            ax.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=8)
            ax.set_title(f"{workload}: {title}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "replicas.png", dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
