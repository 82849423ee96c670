"""Plots for bench/router_overhead.py; runs in bench/.venv-peers (matplotlib lives there).

    bench/.venv-peers/bin/python bench/router_overhead_plot.py RESULTS.json OUT_DIR

Writes OUT_DIR/router_cpu_per_request.png and OUT_DIR/router_added_latency.png: grouped bars by
concurrency, one bar per router, the median over repeats with min-max error bars; one panel per
mode (non-streaming, streaming) that the run measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"pd-vllm": "#1f77b4", "pd-vllm-default": "#2ca02c", "vllm-router": "#aec7e8",
          "pd-sglang": "#d62728", "sglang-router": "#ff9896", "naive": "#bbbbbb",
          "floor": "#555555"}
STREAM_SUFFIX = ":stream"  # bench/router_overhead.py's key for a target's streaming rows


def modes(results: dict) -> list[bool]:
    return sorted({t.get("stream", False) for t in results["targets"]})


def mode_name(stream: bool) -> str:
    return "streaming" if stream else "non-streaming"


def bars(ax, results: dict, metric: str, ylabel: str, title: str, stream: bool) -> None:
    meta, summary = results["meta"], results["summary"]
    conc = [str(c) for c in meta["concurrency"]]
    routers = [t for t in results["targets"] if t.get("stream", False) == stream
               and t["key"].removesuffix(STREAM_SUFFIX) in COLORS and t["key"] in summary]
    width = 0.8 / max(1, len(routers))
    for i, t in enumerate(routers):
        xs, ys, lo, hi = [], [], [], []
        for j, c in enumerate(conc):
            s = summary[t["key"]].get(c, {}).get(metric)
            if not s:
                continue
            xs.append(j + (i - (len(routers) - 1) / 2) * width)
            ys.append(s["median"])
            lo.append(s["median"] - s["min"])
            hi.append(s["max"] - s["median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=t["label"],
               color=COLORS[t["key"].removesuffix(STREAM_SUFFIX)],
               edgecolor="black", linewidth=0.5)
        for x, y, up, down in zip(xs, ys, hi, lo):  # above the error bar, not on it
            ax.annotate(f"{y:.0f}" if abs(y) >= 10 else f"{y:.2f}",
                        (x, y + up if y >= 0 else y - down), ha="center",
                        va="bottom" if y >= 0 else "top", fontsize=7, xytext=(0, 2),
                        textcoords="offset points")
    ax.set_xticks(range(len(conc)), [f"concurrency {c}" for c in conc])
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def main() -> None:
    results = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    meta = results["meta"]
    note = f"{meta['repeats']} repeat(s), median with min–max; {meta['date']}"

    ms = modes(results)
    fig, axes = plt.subplots(len(ms), 1, figsize=(10, 4.5 * len(ms)), squeeze=False)
    for ax, stream in zip(axes[:, 0], ms):
        bars(ax, results, "cpu_us", "router CPU time per request (µs)",
             f"Router CPU per PD request, {mode_name(stream)} (router pinned to one core)\n{note}",
             stream)
    fig.tight_layout()
    fig.savefig(out / "router_cpu_per_request.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(ms), 2, figsize=(14, 4.5 * len(ms)), squeeze=False)
    for row, stream in zip(axes, ms):
        for ax, metric, what in zip(row, ("added_p50_ms", "added_p99_ms"), ("p50", "p99")):
            bars(ax, results, metric, "ms",
                 f"Added {what} latency vs direct to decode, {mode_name(stream)}\n{note}", stream)
    fig.tight_layout()
    fig.savefig(out / "router_added_latency.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / 'router_cpu_per_request.png'} and {out / 'router_added_latency.png'}")


if __name__ == "__main__":
    main()
