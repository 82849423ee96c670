"""Multi-turn serving: conversation pinning + append-prefill (our `multi_turn` preset, and
pd-router's default policy, which should be within 5% of it) against plain PD (`vllm_kv_aware`,
every turn through a prefill leg) and vllm-router-style session affinity
(`vllm_session_affinity`: pinned decode, still a prefill leg every turn), on generated
conversations (pd_plugins/workloads/conversations.py), in the simulator and over HTTP.

    .venv/bin/python -m bench.multi_turn            # ~15 minutes (--repeats 3: ~19)
    .venv/bin/python -m bench.multi_turn --quick    # ~6 minutes

Reports turn-2+ TTFT and TPOT (all turns: appends slow the decodes running beside them) p50/p95,
with ratios to plain PD; the simulator's spread when the replay's arrivals move by a few ms; and
each replay's TTFT split into the engines' model time (the mocks' /mock/timings) and the rest
(HTTP, the router, processes waking). Writes bench/results/multi_turn.json, docs/img/multi_turn.png and the
"Multi-turn serving" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgspec
from tqdm import tqdm

from bench import common
from pd_plugins.perf.cluster_sim import SimConfig, simulate
from pd_plugins.perf.hardware import preset as hardware_preset
from pd_plugins.mock.client import attach_engine_times
from pd_plugins.perf.replay import ReplayOutcome, replay, send_request
from pd_plugins.perf.report import cdf, percentile
from pd_plugins.routers.policy.scheduler import DEFAULT_POLICY
from pd_plugins.testing.router_harness import MockEngineProcess, modelled_deployment
from pd_plugins.workloads import ConversationSpec, generate_conversations

HARDWARE = "llama-3.1-8b@h100"
CLUSTER = (2, 2)
POLICIES = ("vllm_kv_aware", "vllm_session_affinity", "multi_turn", DEFAULT_POLICY)
BASELINE = "vllm_kv_aware"
# Ours again in the simulator, its decodes with a small token budget per step (vLLM's
# --max-num-batched-tokens on the decode instances): an appended turn's prefill then runs in
# chunks beside the decodes (Sarathi-style), trading some TTFT for less stall. Plain PD's decodes
# never prefill, so the budget changes nothing for it.
CHUNKED, DECODE_BUDGET = "multi_turn_chunked", 384
OURS = ("multi_turn", CHUNKED, DEFAULT_POLICY)
# pd-router's default against the best of ours (per metric, lower is better): within 5%
DEFAULT_TARGET = 1.05
METRICS = {"ttft2_p50": "turn-2+ TTFT p50", "ttft2_p95": "turn-2+ TTFT p95", "tpot_p50": "TPOT p50",
           "tpot_p95": "TPOT p95"}
BLOCK = 16  # tokens per cached block, as vLLM's on GPU: the simulator's and the mock engines'
# its stated distributions, hashed in the engines' blocks; the session rate is swept
SPEC = ConversationSpec(block_tokens=BLOCK)
SIM_RATES = (1.0, 2.0, 4.0, 6.0)  # new sessions per second
# The replay runs in real time (speedup 1): the router's and the mock engines' own time per
# request (~3 ms on this 2-core machine, HTTP and streaming) is real, and a faster clock would
# count it double against the modelled engine times (at speedup 2 it cost ours ~10 ms per turn).
REPLAY_RATE, REPLAY_SESSIONS, SPEEDUP, SCRAPE_S = 2.0, 80, 1.0, 0.25
REPLAY_REQUESTS = 160  # the first ones by arrival: the think-time tail would make a replay long
# The simulator again on the replay's requests, every arrival delayed by up to this much (uniform,
# one seed per run): about the timing noise the replay's client and router add. Which decode a
# conversation lands on and what runs beside it then change, and ours' turn-2+ TTFT with them.
JITTER_S, JITTER_SEEDS = 0.003, range(1, 10)
RESULTS = common.RESULTS / "multi_turn.json"


def conversations(rate: float, sessions: int):
    spec = dataclasses.replace(SPEC, session_rate_per_s=rate)
    return generate_conversations(spec, sessions, seed=1)


def summary(outcomes) -> dict:
    ok = [o for o in outcomes if o.status == "ok"]
    later = [o.ttft_s for o in ok if o.turn > 0]
    tpot = [o.tpot_s for o in ok if o.tpot_s]
    # the engines' own share of each turn-2+ TTFT, and the rest: HTTP, the router and the
    # processes' wake-ups in a replay, the modelled network hops in the simulator
    timed = [(o.ttft_s, t) for o in ok if o.turn > 0 and (t := engine_time(o)) is not None]
    engines = {"engine_timed": len(timed),
               "engine_ttft2_p50": percentile([t for _, t in timed], 50),
               "outside_ttft2_p50": percentile([ttft - t for ttft, t in timed], 50),
               } if timed else {}
    return {**engines, "requests": len(outcomes), "served": len(ok),
            "appended": sum(1 for o in ok if o.turn > 0 and not o.disaggregated),
            "later_turns": len(later),
            "ttft2_p50": percentile(later, 50), "ttft2_p95": percentile(later, 95),
            "tpot_p50": percentile(tpot, 50), "tpot_p95": percentile(tpot, 95),
            "ttft2_cdf": cdf(later), "tpot_cdf": cdf(tpot)}


def simulated(reqs, policy: str) -> dict:
    budget = DECODE_BUDGET if policy == CHUNKED else None
    config = SimConfig(hardware_preset(HARDWARE), *CLUSTER, block_tokens=BLOCK,
                       policy="multi_turn" if policy == CHUNKED else policy,
                       decode_max_batched_tokens=budget)
    r = simulate(reqs, config)
    return {**summary(r.outcomes), "kv_gb_moved": r.kv_bytes_moved / 1e9}


def engine_time(outcome) -> float | None:
    """Seconds of a request's TTFT spent in the engines: the mocks' own model times (replay), or
    the simulator's prefill-leg and decode-leg shares."""
    if getattr(outcome, "engine_ttft_s", None) is not None:
        return outcome.engine_ttft_s
    if outcome.decode_first_s is None:
        return None
    return (outcome.prefill_leg_s or 0.0) + outcome.decode_first_s


def replay_requests(sessions: int, count: int = REPLAY_REQUESTS):
    return conversations(REPLAY_RATE, sessions)[:count]


def jittered(reqs, seed: int):
    rng = random.Random(seed)
    late = [dataclasses.replace(r, arrival_s=r.arrival_s + rng.uniform(0, JITTER_S)) for r in reqs]
    return sorted(late, key=lambda r: r.arrival_s)


def replayed(reqs, policy: str, log_dir: Path) -> dict:
    with modelled_deployment(HARDWARE, *CLUSTER, policy, speedup=SPEEDUP, block_size=BLOCK,
                             scrape_s=SCRAPE_S, log_dir=log_dir) as (router, engines):
        with tqdm(total=len(reqs), desc=f"  {policy} replay", unit="req") as bar:
            result = asyncio.run(replay(router.url, reqs, SPEEDUP, "mock", timeout_s=600, mock_outputs=True,
                                        progress=lambda done: bar.update(done - bar.n)))
        asyncio.run(attach_engine_times(result.outcomes, reqs, [e.url for e in engines]))
    return summary(result.outcomes)


async def _round_trips(url: str, gap_s: float, count: int) -> list[float]:
    """Seconds from sending a 1-token streamed completion to its token, `gap_s` apart (the
    replay's own request code, so the same TTFT as the replay measures)."""
    loop = asyncio.get_running_loop()
    body = msgspec.json.encode({"model": "mock", "prompt": [1, 2, 3], "max_tokens": 1, "stream": True})
    times = []
    async with aiohttp.ClientSession() as session:
        for i in range(count + 5):  # the first few open the connection
            out = ReplayOutcome(i, 0.0, 3, 1)
            await send_request(session, f"{url}/v1/completions", body, out, loop.time(), 1.0, loop)
            if out.status != "ok":
                raise RuntimeError(f"the HTTP floor's mock failed a request: {out.error}")
            if i >= 5:
                times.append(out.ttft_s)
            await asyncio.sleep(gap_s)
    return times


def http_floor(log_dir: Path, count: int = 200) -> dict:
    """The instrument's own cost: a mock engine without a latency model answering a 1-token
    request, back to back and after 20 ms idle (p50 seconds)."""
    engine = MockEngineProcess("floor", log_dir=log_dir)
    try:
        engine.start()
        engine.wait_healthy(60)
        return {f"gap_{gap * 1e3:g}ms": percentile(asyncio.run(_round_trips(engine.url, gap, count)), 50)
                for gap in (0.0, 0.02)}
    finally:
        engine.stop(grace=5)


def pct(value: float | None, base: float | None) -> str:
    return "-" if not value or not base else f"{value / base - 1:+.0%}"


def rows(label: str, by_policy: dict) -> list[str]:
    base = by_policy[BASELINE]
    out = []
    for policy in (p for p in (*POLICIES, CHUNKED) if p in by_policy):
        s = by_policy[policy]
        name = (f"multi_turn, decode budget {DECODE_BUDGET} (ours)" if policy == CHUNKED
                else f"{policy} (ours, pd-router's default)" if policy == DEFAULT_POLICY
                else f"{policy} (ours)" if policy in OURS else policy)
        out.append(f"| {label} | {name} | "
                   f"{s['appended']}/{s['later_turns']} | "
                   f"{s['ttft2_p50'] * 1e3:.0f} ms ({pct(s['ttft2_p50'], base['ttft2_p50'])}) | "
                   f"{s['ttft2_p95'] * 1e3:.0f} ms ({pct(s['ttft2_p95'], base['ttft2_p95'])}) | "
                   f"{s['tpot_p50'] * 1e3:.2f} ms ({pct(s['tpot_p50'], base['tpot_p50'])}) | "
                   f"{s['tpot_p95'] * 1e3:.2f} ms ({pct(s['tpot_p95'], base['tpot_p95'])}) |")
    return out


def verdict(label: str, by_policy: dict, policy: str) -> str:
    """Ours against plain PD: turn-2+ TTFT at least 60% lower (p50; p95 stated), TPOT p95 within 5%."""
    ours, base = by_policy[policy], by_policy[BASELINE]
    ttft50, ttft95 = (ours[k] / base[k] - 1 for k in ("ttft2_p50", "ttft2_p95"))
    tpot95 = ours["tpot_p95"] / base["tpot_p95"] - 1
    met = ttft50 <= -0.60 and tpot95 <= 0.05
    return (f"{label} {'met' if met else 'missed'} (TTFT p50 {ttft50:+.1%}, p95 {ttft95:+.0%}; "
            f"TPOT p95 {tpot95:+.1%})")


def against_best_of_ours(label: str, by_policy: dict) -> str | None:
    """The default against the best of our other presets in this case, metric by metric."""
    others = [p for p in OURS if p != DEFAULT_POLICY and p in by_policy]
    if DEFAULT_POLICY not in by_policy or not others:
        return None
    mine, parts, met = by_policy[DEFAULT_POLICY], [], True
    for key, name in METRICS.items():
        best = min(others, key=lambda p: by_policy[p][key])
        ratio = mine[key] / by_policy[best][key]
        met &= ratio <= DEFAULT_TARGET
        parts.append(f"{name} {ratio:.2f}x (`{best}`)")
    return f"{label} {'met' if met else 'missed'} ({', '.join(parts)})"


def markdown(results: dict) -> str:
    meta = results["meta"]
    spec = meta["spec"]
    lines = ["<!-- multi-turn:start -->", "## Multi-turn serving (pinning and append-prefill)", "",
             f"Written by `bench/multi_turn.py{' --quick' if meta['quick'] else ''}` on {meta['date']} "
             f"({meta['machine']}), {meta['wall_min']:.1f} min.", "",
             f"Generated conversations (seed 1): Poisson session arrivals; turns 1 + geometric, mean "
             f"{spec['mean_turns']:g}; user turns lognormal median {spec['user_tokens_median']:g} tokens, "
             f"answers median {spec['assistant_tokens_median']:g}; a {spec['shared_system_tokens']}-token "
             f"system prompt; think time median {spec['think_time_median_s']:g} s; prompts cached in "
             f"{spec.get('block_tokens', 512)}-token blocks by the simulator and the mock engines. Cluster "
             f"{CLUSTER[0]}P+{CLUSTER[1]}D x {HARDWARE}. Plain PD is `{BASELINE}` (every turn through "
             "a prefill leg, prefix-cache credit on the prefill); `vllm_session_affinity` pins a "
             "conversation's decode like vllm-router's sticky sessions; ours, `multi_turn`, pins it "
             "(ConServe) and appends later turns on that decode without a prefill leg (PPD, under 512 "
             "uncached tokens, or when the TTFT it saves beats a tenth of the time the decodes running "
             f"there wait for it). `{DEFAULT_POLICY}`, pd-router's default policy, routes single-turn "
             "traffic as `goodput` does and conversations as `multi_turn` does (it also moves a "
             "conversation off a saturated decode worker). "
             "The simulator and the replay (real pd-router over HTTP, "
             f"mock engines on the same model, clock speedup {meta.get('speedup', 2.0):g}) route with the same "
             "policy code. Turn-2+ TTFT is over "
             "turns after the first; TPOT over every request (appends slow the decodes beside them). "
             "In brackets: the change against plain PD. Targets (issue 5): turn-2+ TTFT at least 60% "
             "lower, TPOT p95 within 5%.", "",
             "| where | policy | appended | turn-2+ TTFT p50 | turn-2+ TTFT p95 | TPOT p50 | TPOT p95 |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for rate, by_policy in results["sim"].items():
        lines += rows(f"simulator, {float(rate):g} sessions/s", by_policy)
    replay_label = f"{REPLAY_RATE:g} sessions/s (first {meta.get('replay_requests', REPLAY_REQUESTS)} requests)"
    if "sim_of_replay" in results:
        lines += rows(f"simulator, {replay_label}", results["sim_of_replay"])
    for by_policy in results["replay"]:
        lines += rows(f"replay, {replay_label}", by_policy)
    cases = ([(f"simulator at {float(rate):g} sessions/s", b) for rate, b in results["sim"].items()]
             + ([("simulator on the replay's requests", results["sim_of_replay"])]
                if "sim_of_replay" in results else [])
             + [(f"replay {i + 1}", b) for i, b in enumerate(results["replay"])])
    for policy in OURS:
        named = [(label, b) for label, b in cases if policy in b]
        if named:
            lines += ["", f"Against the targets, `{policy}`"
                      + (f" (decode budget {DECODE_BUDGET} tokens)" if policy == CHUNKED else "")
                      + ": " + "; ".join(verdict(label, b, policy) for label, b in named) + "."]
    versus = [line for label, b in cases if (line := against_best_of_ours(label, b))]
    if versus:
        lines += ["", f"`{DEFAULT_POLICY}` (pd-router's default) against the best of our other presets, "
                  f"metric by metric (target: within {DEFAULT_TARGET - 1:.0%}): " + "; ".join(versus) + "."]
    reps = results["replay"]
    if reps:
        lines += ["", f"Replay spread over {len(reps)} runs, turn-2+ TTFT p50: " + "; ".join(
            f"{p} {common.spread([r[p]['ttft2_p50'] * 1e3 for r in reps], '{:.0f} ms')}"
            for p in POLICIES) + "."]
    if "sim_of_replay_jitter" in results:
        lines += ["", jitter_spread(results["sim_of_replay_jitter"])]
    if reps and "sim_of_replay" in results and all("engine_ttft2_p50" in r[p] for r in reps for p in POLICIES):
        lines += ["", instrument_split(results["sim_of_replay"], reps, results.get("http_floor"))]
    lines += ["", "![multi-turn](img/multi_turn.png)", "", "<!-- multi-turn:end -->"]
    return "\n".join(lines) + "\n"


def jitter_spread(runs: dict) -> str:
    """The simulator on the replay's requests with arrivals jittered: turn-2+ TTFT p50 per policy
    and ours against plain PD, median and range over the seeds."""
    change = [o["ttft2_p50"] / b["ttft2_p50"] - 1 for o, b in zip(runs["multi_turn"], runs[BASELINE])]
    tpot = [o["tpot_p95"] / b["tpot_p95"] - 1 for o, b in zip(runs["multi_turn"], runs[BASELINE])]
    return (f"The simulator on the replay's requests again, every arrival delayed by 0 to "
            f"{JITTER_S * 1e3:g} ms (uniform; {len(change)} seeds), about the timing noise of the replay's "
            "client and router. Turn-2+ TTFT p50: " + "; ".join(
                f"{p} {common.spread([r['ttft2_p50'] * 1e3 for r in runs[p]], '{:.1f} ms')}"
                for p in POLICIES)
            + f". Ours against plain PD: {common.spread(change, '{:+.1%}')}, TPOT p95 "
            f"{common.spread(tpot, '{:+.1%}')}. Which decode a conversation lands on, and what "
            "runs beside it, moves ours' p50 by a millisecond or more.")


def instrument_split(sim: dict, reps: list[dict], floor: dict | None) -> str:
    """The replays' turn-2+ TTFT split into the engines' model time (/mock/timings) and the rest
    (HTTP, the router, processes waking), median over the replays."""
    def med(policy: str, key: str) -> float:
        return statistics.median(r[policy][key] for r in reps)
    engine = {p: med(p, "engine_ttft2_p50") for p in POLICIES}
    outside = {p: med(p, "outside_ttft2_p50") for p in POLICIES}
    per_replay = [r["multi_turn"]["engine_ttft2_p50"] / r[BASELINE]["engine_ttft2_p50"] - 1 for r in reps]
    text = ("Where the replays' turn-2+ TTFT goes (median over the replays of each one's p50). In the "
            "engines, the model time from each leg reaching its engine to its first token, summed over "
            "the request's legs (the mocks' `/mock/timings`): " + "; ".join(
                f"{p} {engine[p] * 1e3:.1f} ms" for p in POLICIES)
            + f", ours against plain PD {engine['multi_turn'] / engine[BASELINE] - 1:+.1%} (per replay: "
            + ", ".join(f"{c:+.1%}" for c in per_replay) + "). Outside them, HTTP through the router, the "
            "router's own work and the processes waking on this 2-core machine: " + "; ".join(
                f"{p} {outside[p] * 1e3:.1f} ms" for p in POLICIES) + " per request")
    if floor:
        text += (f" (for scale, a 1-token request straight to a mock without latency model: p50 "
                 f"{floor['gap_20ms'] * 1e3:.2f} ms after 20 ms idle, "
                 f"{floor['gap_0ms'] * 1e3:.2f} ms back to back)")
    sim_engine = {p: sim[p]["engine_ttft2_p50"] for p in (BASELINE, "multi_turn")}
    text += (". The simulator on the same requests spends, in the engines, "
             f"{sim_engine[BASELINE] * 1e3:.1f} ms (plain PD) and {sim_engine['multi_turn'] * 1e3:.1f} ms "
             f"(ours): {sim_engine['multi_turn'] / sim_engine[BASELINE] - 1:+.1%}")
    ours, base = sim["multi_turn"]["ttft2_p50"], sim[BASELINE]["ttft2_p50"]
    return text + (f". The cost outside the engines is of the same size for every policy, so it weighs "
                   f"more on ours' shorter TTFT: the simulator's {ours * 1e3:.1f} ms against "
                   f"{base * 1e3:.1f} ms is {ours / base - 1:+.1%}; with each policy's cost outside the "
                   f"engines added, {(ours + outside['multi_turn']) / (base + outside[BASELINE]) - 1:+.1%}.")


def render() -> int:
    results = json.loads(RESULTS.read_text())
    common.publish("multi-turn", markdown(results), "multi_turn_plot.py", RESULTS, common.IMG)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()
    if args.render:
        return render()
    started = time.monotonic()
    sessions = 150 if args.quick else 600
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 2)
    replay_sessions = 30 if args.quick else REPLAY_SESSIONS
    replay_count = 50 if args.quick else REPLAY_REQUESTS  # the first ones: the think-time tail is long
    results = {"meta": {"date": dt.date.today().isoformat(), "machine": common.machine(), "quick": args.quick,
                        "spec": dataclasses.asdict(SPEC), "sessions": sessions, "replay_sessions": replay_sessions,
                        "replay_requests": replay_count,
                        "speedup": SPEEDUP},
               "sim": {}, "replay": []}
    jobs = [(rate, p) for rate in SIM_RATES for p in (*POLICIES, CHUNKED)]
    for rate, policy in tqdm(jobs, desc="simulations", unit="run"):
        results["sim"].setdefault(str(rate), {})[policy] = simulated(conversations(rate, sessions), policy)
    # the replay's own requests through the simulator: what the replay adds to it includes the
    # instrument's own cost (http_floor)
    reqs = replay_requests(replay_sessions, replay_count)
    results["sim_of_replay"] = {p: simulated(reqs, p) for p in POLICIES}
    results["sim_of_replay_jitter"] = {
        p: [{k: v for k, v in simulated(jittered(reqs, seed), p).items() if not k.endswith("_cdf")}
            for seed in tqdm(JITTER_SEEDS, desc=f"  {p}, arrivals jittered", unit="run")]
        for p in POLICIES}
    with tempfile.TemporaryDirectory(prefix="multi-turn-") as log_dir:
        results["http_floor"] = http_floor(Path(log_dir))
        for i in range(repeats):
            results["replay"].append({p: replayed(reqs, p, Path(log_dir)) for p in POLICIES})
    results["meta"]["wall_min"] = (time.monotonic() - started) / 60
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results))
    return render()


if __name__ == "__main__":
    sys.exit(main())
