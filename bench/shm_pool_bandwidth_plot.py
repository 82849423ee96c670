"""Plot for bench/shm_pool_bandwidth.py; runs in bench/.venv-peers (matplotlib lives there).

    bench/.venv-peers/bin/python bench/shm_pool_bandwidth_plot.py RESULTS.json OUT_DIR

OUT_DIR/shm_pool_bandwidth.png: GB/s against the block size, one line per case (median over
repetitions, p10-p90 error bars), and beside it each pool case's ratio to memcpy with the 90% target.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STYLE = {  # case -> (label, color, line style)
    "memcpy": ("memcpy (np.copyto)", "black", "--"),
    "write": ("pool write", "#d62728", "-"),
    "write_plain": ("pool write, no checksums", "#ff9896", "-."),
    "read": ("pool read", "#1f77b4", "-"),
    "read_plain": ("pool read, no checksums", "#aec7e8", "-."),
    "read_xproc": ("pool read, other process", "#2ca02c", "-"),
}
TARGET = 0.9


def size_name(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def lines(ax, results: dict, metric: str, cases) -> None:
    blocks = results["meta"]["block_sizes"]
    for case in cases:
        label, color, style = STYLE[case]
        stats = [results["summary"][case][str(b)][metric] for b in blocks]
        mid = [s["median"] for s in stats]
        err = [[s["median"] - s["p10"] for s in stats], [s["p90"] - s["median"] for s in stats]]
        ax.errorbar(blocks, mid, yerr=err, capsize=3, marker="o", markersize=4, color=color,
                    linestyle=style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(blocks, [size_name(b) for b in blocks])
    ax.set_xlabel("block (slot) size")
    ax.grid(alpha=0.3)


def main(results_path: str, out_dir: str) -> None:
    results = json.loads(Path(results_path).read_text())
    meta = results["meta"]
    fig, (bw, ratio) = plt.subplots(1, 2, figsize=(13, 4.8))
    lines(bw, results, "gbps", STYLE)
    bw.set(ylabel="GB/s (1e9 bytes/s)", ylim=(0, None),
           title=f"{meta['total_bytes'] >> 20} MiB per pass, batches of {meta['batch']} blocks")
    lines(ratio, results, "ratio", [c for c in STYLE if c != "memcpy"])
    ratio.axhline(TARGET, color="gray", linestyle=":", label=f"target ({TARGET:.0%} from 64 KiB)")
    ratio.set(ylabel="pool / memcpy (same repetition)", ylim=(0, None), title="ratio to memcpy")
    for ax in (bw, ratio):
        ax.legend(fontsize=8)
    fig.suptitle(f"Shared-memory KV pool bandwidth ({meta['date']}, median and p10-p90 over "
                 f"{meta['repeats']} repetitions)", fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(out_dir) / "shm_pool_bandwidth.png", dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
