"""A replay's questions to the mocks it ran against, over HTTP: their counters (`/mock/stats`) and
each leg's time in the engine (`/mock/timings`).

    result = asyncio.run(replay(router_url, reqs, speedup=20, model="mock", timeout_s=60))
    stats = asyncio.run(collect_engine_stats(engine_urls))
    asyncio.run(attach_engine_times(result.outcomes, reqs, engine_urls))
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Sequence

import aiohttp

from pd_plugins.mock.protocol import STATS_PATH, TIMINGS_PATH, prompt_digest
from pd_plugins.workloads import TraceRequest, prompt_token_ids

if TYPE_CHECKING:
    from pd_plugins.perf.replay import ReplayOutcome

# report.summarize's keyword -> the modelled mocks' /mock/stats counter
ENGINE_COUNTERS = {"cached_tokens": "prompt_tokens_cached", "computed_tokens": "prefill_tokens_computed",
                   "transfer_tokens": "transfer_tokens", "kv_bytes_moved": "transfer_bytes"}


async def collect_engine_stats(urls: Sequence[str], timeout_s: float = 10.0) -> dict:
    """The modelled mocks' /mock/stats counters, summed: `cached_tokens`, `computed_tokens` and
    `kv_bytes_moved` (report.summarize's keyword arguments), `transfer_tokens`, and each engine's
    whole answer under `engines` (an unreachable engine answers {} and counts 0)."""
    totals: dict = dict.fromkeys(ENGINE_COUNTERS, 0)
    engines: dict[str, dict] = {}
    for url, data in zip(urls, await _get_from_each(urls, STATS_PATH, timeout_s)):
        engines[url] = data = data or {}
        for name, counter in ENGINE_COUNTERS.items():
            value = data.get(counter, 0)
            if isinstance(value, (int, float)) and math.isfinite(value):
                totals[name] += value
    return {**totals, "engines": engines}


async def attach_engine_times(outcomes: Sequence[ReplayOutcome], requests: Sequence[TraceRequest],
                              urls: Sequence[str], timeout_s: float = 30.0) -> int:
    """Fill each served outcome's `engine_ttft_s` from the modelled mocks' /mock/timings: the sum,
    over its legs (a prefill leg and the decode leg, or one local leg), of the model time from
    reaching the engine to its first token. Matched by prompt digest; a prompt with more than one
    leg of a kind (a retry) is left unmatched. Returns how many outcomes were matched."""
    answers = await _get_from_each(urls, TIMINGS_PATH, timeout_s)
    for url, answer in zip(urls, answers):
        if answer is None:
            raise RuntimeError(f"{url} gave no {TIMINGS_PATH} (is it a mock with --latency-model?)")
    legs: dict[str, dict[str, float | None]] = {}
    for leg in (leg for answer in answers for leg in answer["timings"]):
        kinds = legs.setdefault(leg["prompt"], {})
        kinds[leg["leg"]] = None if leg["leg"] in kinds else leg["first_token_s"] - leg["arrived_s"]
    by_id = {r.request_id: r for r in requests}
    matched = 0
    for out in outcomes:
        if out.status != "ok" or out.request_id not in by_id:
            continue
        kinds = legs.get(prompt_digest({"prompt": prompt_token_ids(by_id[out.request_id])}), {})
        if kinds and None not in kinds.values():
            out.engine_ttft_s = sum(kinds.values())
            matched += 1
    return matched


async def _get_from_each(urls: Sequence[str], path: str, timeout_s: float) -> list[dict | None]:
    """GET `path` from every engine at once: each one's JSON answer, or None where it did not
    answer 200 with JSON."""
    async def one(session: aiohttp.ClientSession, url: str) -> dict | None:
        try:
            async with session.get(url.rstrip("/") + path) as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        return await asyncio.gather(*(one(session, u) for u in urls))
