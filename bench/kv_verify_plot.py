"""Plot for bench/kv_verify.py; runs in bench/.venv-peers (matplotlib lives there).

    bench/.venv-peers/bin/python bench/kv_verify_plot.py RESULTS.json OUT.png

Left: the decode leg's overhead with verify_kv on (paired on/off - 1 per round), median with
p10-p90 bars, per transport and prompt length, against issue 28's 2 % goal. Right: the decode
leg's median with verification off and on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GOAL_PCT = 2.0


def main(results_path: str, out: str) -> None:
    runs = json.loads(Path(results_path).read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels, x = [], 0
    for run in runs.values():
        for length, s in sorted(run["summary"].items(), key=lambda kv: int(kv[0])):
            p = s["paired"]
            if not p:
                continue
            o = p["decode_overhead"]
            mid = o["p50"] * 100
            left.errorbar([x], [mid], yerr=[[mid - o["p10"] * 100], [o["p90"] * 100 - mid]],
                          marker="o", capsize=4, color="C0")
            for dx, verify, color in ((-0.15, "off", "C1"), (0.15, "on", "C2")):
                right.bar(x + dx, s[verify]["decode_s"]["p50"] * 1e3, width=0.3, color=color,
                          label=f"verify_kv {verify}" if x == 0 else None)
            short = (run["name"].replace("PdNixlConnector", "NIXL").replace("PdShmConnector", "shm")
                     .replace("PdLMCacheConnector", "LMCache"))
            labels.append(f"{short}\n{length} tok")
            x += 1
    left.axhline(GOAL_PCT, color="red", linestyle="--", label="goal: 2 %")
    left.axhline(0, color="grey", linewidth=0.5)
    left.set_ylabel("decode leg overhead, % (median, p10-p90)")
    left.set_title("verify_kv on vs off, paired per round")
    right.set_ylabel("decode leg, ms (median)")
    right.set_title("decode leg")
    for ax in (left, right):
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
