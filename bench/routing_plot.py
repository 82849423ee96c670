"""Plots for bench/routing_sim.py; runs in bench/.venv-peers (matplotlib lives there).

    bench/.venv-peers/bin/python bench/routing_plot.py RESULTS.json OUT_DIR

One figure per trace, OUT_DIR/routing_<trace>.png: SLO attainment against request rate (the
90% line marks goodput), TTFT and TPOT CDFs at the middle rate, and prefix-cache hit rate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(results_path: str, out_dir: str) -> None:
    results = json.loads(Path(results_path).read_text())
    meta = results["meta"]
    ours = meta["ours"]
    for trace in results["traces"]:
        pols: dict[str, list[dict]] = {}
        for r in results["runs"]:
            if r["trace"] == trace:
                pols.setdefault(r["policy"], []).append(r)
        fig, axes = plt.subplots(2, 3, figsize=(17, 8.5))
        (att, good, hit), (ttft, tpot, mean_ttft) = axes
        for policy in meta["policies"]:
            runs = sorted(pols.get(policy, []), key=lambda r: r["rate"])
            if not runs:
                continue
            style = {"linewidth": 2.6, "color": "black"} if policy == ours else {"linewidth": 1.3}
            label = f"{policy} (ours)" if policy == ours else policy
            rates = [r["rate"] for r in runs]
            att.plot(rates, [r["slo_attainment"] for r in runs], marker="o", markersize=3, label=label, **style)
            hit.plot(rates, [r["cache_hit_rate"] or 0 for r in runs], marker="o", markersize=3, label=label, **style)
            mean_ttft.plot(rates, [r["ttft_s"]["mean"] for r in runs], marker="o", markersize=3, label=label, **style)
            mid = runs[len(runs) // 2]
            ttft.plot(*mid["ttft_cdf"], label=label, **style)
            tpot.plot([x * 1e3 for x in mid["tpot_cdf"][0]], mid["tpot_cdf"][1], label=label, **style)
        names = [p for p in meta["policies"] if p in pols]
        values = [results["goodput"][trace][p] for p in names]
        good.bar(range(len(names)), values, color=["black" if p == ours else "#7f7f7f" for p in names])
        good.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        good.set(ylabel="goodput (req/s)", title="goodput: highest rate with >= 90% attainment")
        mean_ttft.set(xlabel="request rate (req/s)", ylabel="mean TTFT of served requests (s)",
                      yscale="log", title="mean TTFT")
        mid_rate = sorted(pols[ours], key=lambda r: r["rate"])[len(pols[ours]) // 2]["rate"]
        att.axhline(0.9, color="grey", linestyle="--", linewidth=1)
        slo = meta["slo"][trace]
        att.set(xlabel="request rate (req/s)", ylabel="SLO attainment", ylim=(0, 1.02),
                title=f"SLO attainment (TTFT <= {slo['ttft_s']:g} s, TPOT <= {slo['tpot_s'] * 1e3:g} ms)")
        hit.set(xlabel="request rate (req/s)", ylabel="prefix-cache hit rate", title="prompt tokens found cached")
        ttft.set(xlabel="TTFT (s)", ylabel="share of served requests", xscale="log",
                 title=f"TTFT CDF at {mid_rate:.1f} req/s")
        tpot.set(xlabel="TPOT (ms)", ylabel="share of served requests", title=f"TPOT CDF at {mid_rate:.1f} req/s")
        for ax in (att, hit, ttft, tpot, mean_ttft):
            ax.grid(alpha=0.3)
        att.legend(fontsize=8)
        p, d = meta["cluster"]
        fig.suptitle(f"{trace}: {p}P+{d}D x {meta['hardware']} (simulated)", fontsize=12)
        fig.tight_layout()
        fig.savefig(Path(out_dir) / f"routing_{trace}.png", dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
