"""Plots for bench/multi_turn.py; runs in bench/.venv-peers (matplotlib lives there).

    bench/.venv-peers/bin/python bench/multi_turn_plot.py RESULTS.json OUT_DIR

OUT_DIR/multi_turn.png: turn-2+ TTFT and TPOT p50/p95 against the session rate (simulator), and
the turn-2+ TTFT CDF of the first replay.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"vllm_kv_aware": "#7f7f7f", "vllm_session_affinity": "#1f77b4", "multi_turn": "black",
          "multi_turn_chunked": "#d62728", "default": "#2ca02c"}


def main(results_path: str, out_dir: str) -> None:
    results = json.loads(Path(results_path).read_text())
    rates = sorted(results["sim"], key=float)
    fig, (ttft, tpot, dist) = plt.subplots(1, 3, figsize=(17, 4.8))
    for policy, color in COLORS.items():
        if policy not in results["sim"][rates[0]]:
            continue
        xs = [float(r) for r in rates]
        for key, ax, style in (("ttft2_p50", ttft, "-"), ("ttft2_p95", ttft, "--"),
                               ("tpot_p50", tpot, "-"), ("tpot_p95", tpot, "--")):
            ax.plot(xs, [results["sim"][r][policy][key] * 1e3 for r in rates], style, marker="o",
                    markersize=3, color=color, label=f"{policy} {key.split('_')[1]}")
        if results["replay"] and policy in results["replay"][0]:
            x, y = results["replay"][0][policy]["ttft2_cdf"]
            dist.plot([v * 1e3 for v in x], y, color=color, label=policy)
    ttft.set(xlabel="new sessions per second", ylabel="ms", title="turn-2+ TTFT (simulator)", yscale="log")
    tpot.set(xlabel="new sessions per second", ylabel="ms", title="TPOT, all turns (simulator)")
    dist.set(xlabel="turn-2+ TTFT (ms)", ylabel="share of turns", xscale="log", title="turn-2+ TTFT CDF (replay)")
    for ax in (ttft, tpot, dist):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(out_dir) / "multi_turn.png", dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
