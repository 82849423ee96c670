"""Plot for bench/kv_transfer.py; runs in bench/.venv-peers (matplotlib lives there).

    bench/.venv-peers/bin/python bench/kv_transfer_plot.py RESULTS.json OUT_DIR [NAME.png]

OUT_DIR/NAME.png (default kv_transfer.png): the KV copies (NIXL READ; a pool's store and load)
and the decode leg against prompt length, per connector, median with p10-p90 bars. Also used by
bench/lmcache_transfer.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(results_path: str, out_dir: str, name: str = "kv_transfer.png") -> None:
    summary = json.loads(Path(results_path).read_text())["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    curves = [(axes[0], case, side, f"{case}: {side.removesuffix('_s')}")
              for case in summary for side in ("load_s", "store_s")
              if not (case.startswith("PdNixl") and side == "store_s")]
    curves += [(axes[1], case, "decode_leg_s", case) for case in summary]
    for ax, case, key, label in curves:
        by_length = summary[case]
        lengths = sorted(by_length, key=int)
        p50 = [by_length[n][key]["p50"] * 1e3 for n in lengths]
        low = [p - by_length[n][key]["p10"] * 1e3 for p, n in zip(p50, lengths)]
        high = [by_length[n][key]["p90"] * 1e3 - p for p, n in zip(p50, lengths)]
        ax.errorbar([int(n) for n in lengths], p50, yerr=[low, high], marker="o", capsize=3,
                    label=label)
    for ax, title in ((axes[0], "KV copies per request (NIXL: the decode's READ)"),
                      (axes[1], "decode leg (max_tokens=1)")):
        ax.set_xlabel("prompt tokens (1 MiB of KV per 32)")
        ax.set_ylabel("ms (median, p10-p90)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")  # a stalled NIXL request can be 1000x the median
    fig.tight_layout()
    fig.savefig(Path(out_dir) / name, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:4])
