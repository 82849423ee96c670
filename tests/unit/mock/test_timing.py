"""mock/timing.py: the fixed delays behind the one timing interface."""

from __future__ import annotations

import asyncio
import time

from pd_plugins.mock.timing import FixedDelays, Work


def timed(coro_fn):
    async def run():
        started = time.monotonic()
        result = await coro_fn()
        return result, time.monotonic() - started
    return asyncio.run(run())


def test_a_local_leg_makes_its_first_token_after_the_prefill_and_one_token_time():
    timing = FixedDelays(ttft_ms=30, prefill_ms_per_token=1, tpot_ms=10)
    run = timing.start(Work("local", prompt_tokens=20, output_tokens=4))

    async def first():
        await run.first_token()
        return run.made
    made, took = timed(first)
    assert made == 1 and not run.done
    assert 0.058 <= took < 1.0  # 30 ms + 20 x 1 ms + one 10 ms token
    _, took = timed(run.finished)
    assert run.made == 4 and run.done and 0.028 <= took < 1.0  # the three tokens left


def test_a_remote_decode_skips_the_prefill_and_streams_token_by_token():
    timing = FixedDelays(ttft_ms=2000, prefill_ms_per_token=0, tpot_ms=5)
    run = timing.start(Work("remote_decode", prompt_tokens=100, output_tokens=3))
    seen = []

    async def stream():
        while not run.done:
            await run.progress()
            seen.append(run.made)
    _, took = timed(stream)
    assert seen == [1, 2, 3] and 0.014 <= took < 1.0  # three token times, not the 2 s prefill


def test_without_a_token_time_every_token_is_made_at_once():
    run = FixedDelays(0, 0, 0).start(Work("local", 10, 50))
    asyncio.run(run.progress())
    assert run.made == 50 and run.done


def test_a_prefill_leg_makes_one_token_after_the_prefill_time():
    run = FixedDelays(ttft_ms=40, prefill_ms_per_token=0, tpot_ms=1000).start(Work("prefill", 10, 1))
    _, took = timed(run.finished)
    assert run.made == 1 and run.done and 0.038 <= took < 0.9  # no 1 s token time on a prefill
