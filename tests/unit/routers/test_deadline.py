"""Deadline: fires at the latest due time armed, never when disarmed, and does not schedule a timer
per arm."""

from __future__ import annotations

import asyncio

from pd_plugins.routers.deadline import Deadline


def run(coro):
    return asyncio.run(coro)


async def _fired_at(arms: list[tuple[float, float]], wait_s: float) -> list[float]:
    """Arm at each (at_s, seconds) from the start; the times `fire` was called."""
    loop = asyncio.get_running_loop()
    start, fired = loop.time(), []
    deadline = Deadline(loop, lambda: fired.append(loop.time() - start))
    for at_s, seconds in arms:
        await asyncio.sleep(max(0.0, start + at_s - loop.time()))
        deadline.arm(seconds)
    await asyncio.sleep(max(0.0, start + wait_s - loop.time()))
    return fired


def test_a_later_arm_moves_the_deadline_out():
    fired = run(_fired_at([(0.0, 0.1), (0.05, 0.2)], 0.4))
    assert len(fired) == 1 and 0.23 <= fired[0] < 0.35  # due at 0.25, not at 0.1


def test_a_shorter_arm_moves_the_deadline_in():
    fired = run(_fired_at([(0.0, 5.0), (0.0, 0.1)], 0.3))
    assert len(fired) == 1 and 0.08 <= fired[0] < 0.25  # due at 0.1, not at 5


def test_disarm_holds_it_until_the_next_arm_and_cancel_drops_it():
    async def go():
        loop = asyncio.get_running_loop()
        fired = []
        deadline = Deadline(loop, lambda: fired.append(1))
        deadline.arm(0.05)
        deadline.disarm()
        await asyncio.sleep(0.1)
        assert fired == [] and not deadline.armed
        deadline.arm(0.05)
        await asyncio.sleep(0.1)
        assert fired == [1] and not deadline.armed  # fires once, then is disarmed
        deadline.arm(0.05)
        deadline.cancel()
        await asyncio.sleep(0.1)
        assert fired == [1]
    run(go())


def test_rearming_for_every_request_schedules_no_timer_per_arm():
    async def go():
        loop = asyncio.get_running_loop()
        scheduled = []
        call_at = loop.call_at
        loop.call_at = lambda when, cb, *a: scheduled.append(when) or call_at(when, cb, *a)
        deadline = Deadline(loop, lambda: None)
        for _ in range(1000):  # requests back to back, each arming the same timeout
            deadline.arm(60.0)
            deadline.disarm()
        deadline.cancel()
        return scheduled
    assert len(run(go())) == 1
