"""pd-planner's plot: the attainment curve of each split and the score of each split.

matplotlib is an optional dependency (`pip install pd-plugins[plot]`; the CPU lock has it), imported
only when a plot is asked for, so planning itself needs nothing beyond the simulator.
"""

from __future__ import annotations

from pathlib import Path

from pd_plugins.planner.split import TARGET_ATTAINMENT, SplitPlan


def write_plot(plan: SplitPlan, path: str | Path) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'pd-plugins[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (curves, scores) = plt.subplots(1, 2, figsize=(12, 4.5))
    cmap = plt.get_cmap("viridis")
    n = max(1, len(plan.curve) - 1)
    for i, c in enumerate(plan.curve):
        rates = sorted(c.attainment)
        best = c.split == plan.best
        curves.plot(rates, [c.attainment[r] for r in rates], marker="o", ms=3 if not best else 5,
                    lw=2.5 if best else 1, color="crimson" if best else cmap(i / n),
                    label=f"{c.split}{' (best)' if best else ''}")
    curves.axhline(TARGET_ATTAINMENT, ls="--", color="grey", lw=0.8)
    curves.set(xscale="log", xlabel="request rate (req/s)", ylabel="SLO attainment",
               ylim=(0, 1.02), title=f"Attainment per split ({plan.slo})")
    curves.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    curves.xaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    curves.tick_params(axis="x", which="minor", labelsize=7)
    curves.legend(fontsize=7, ncol=2)

    labels = [str(c.split) for c in plan.curve]
    if plan.mode == "goodput":
        scores.set(ylabel="goodput (req/s)", title=f"Goodput per split, {plan.instances} instances")
        bars = scores.bar(labels, [c.goodput if c.goodput is not None else 0.0 for c in plan.curve],
                          color="lightsteelblue")
        for bar, c in zip(bars, plan.curve):
            if c.goodput is None:  # ruled out after one simulation: only a bound is known
                scores.annotate(f"< {c.below:.3g}", (bar.get_x() + bar.get_width() / 2, 0),
                                ha="center", va="bottom", fontsize=8, color="grey")
    else:
        bars = scores.bar(labels, [c.attainment[plan.target_rate] for c in plan.curve],
                          color="lightsteelblue")
        scores.axhline(TARGET_ATTAINMENT, ls="--", color="grey", lw=0.8)
        scores.set(ylabel="SLO attainment", ylim=(0, 1.02),
                   title=f"{plan.instances} instances at {plan.target_rate:g} req/s")
    for bar, c in zip(bars, plan.curve):
        if c.split == plan.best:
            bar.set_color("crimson")
        if plan.dynamo is not None and c.split == plan.dynamo:
            bar.set_edgecolor("black")
            bar.set_linewidth(2)
            scores.annotate("Dynamo", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
    scores.tick_params(axis="x", rotation=45, labelsize=8)
    fig.tight_layout()
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out
