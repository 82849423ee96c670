"""The threads a transfer library starts in an engine's process: their priority, and how often
NIXL's progress thread wakes.

NIXL's progress thread polls without pause (its Python API fixes the delay, `pthrDelay`, at 0) and
starts on the engine's own core: on a CPU engine the kernel then shared that core half and half
between it and the model, and a 448-token prefill of tiny-qwen3-moe took 33.4 ms instead of 14.3 ms
(engine side, a one-off measurement; docs/connectors.md). Two remedies, each an option
(transfer/options.py), both defaults on a CPU engine:

- `lowered_new_threads`: the threads NIXL starts run at nice 19, so they run whenever the model
  waits.
- `paced_progress`: the progress thread pauses between its rounds. Nice alone left an idle PD pair
  keeping both cores of this machine busy (each server is its own session, and the kernel shares a
  core between sessions before nice values count): servers started beside it came up late, and the
  engines' own API servers answered /metrics seconds late under test load (docs/connectors.md,
  "Under load", has the counts). With a 100 us pause an idle
  agent's progress thread uses about 2% of a core instead of 100%, and a remote read waits at most
  that long for the side that serves it (UCX over TCP needs the target's progress too).

Used by both engines' NIXL adapters around the call that creates their agents. Engine-agnostic:
the standard library, NIXL and transfer/options.py (Linux; elsewhere nothing is changed).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

from pd_plugins.transfer.options import NixlOptions, variable

logger = logging.getLogger("pd_plugins")

# engines without a connector config (SGLang): a number, or "none"
ENV = variable(NixlOptions, "transfer_threads_nice")


def thread_ids() -> set[int]:
    """This process's threads (Linux; empty elsewhere)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


@contextlib.contextmanager
def lowered_new_threads(nice: int | None, who: str) -> Iterator[None]:
    """Set the threads started inside the block to `nice` (None: leave them alone)."""
    before = thread_ids() if nice is not None else set()
    yield
    if nice is None:
        return
    lowered = []
    for tid in sorted(thread_ids() - before):
        with contextlib.suppress(OSError):  # the thread may have ended already
            os.setpriority(os.PRIO_PROCESS, tid, int(nice))
            lowered.append(tid)
    if lowered:
        logger.info("%s: transfer threads %s at nice %s", who, lowered, nice)


@contextlib.contextmanager
def paced_progress(pause_us: int | None, who: str) -> Iterator[None]:
    """NIXL agents created inside the block pause `pause_us` between progress rounds (None: as
    upstream). NIXL's `nixl_agent` builds its C++ config itself and sets `pthrDelay = 0`; for the
    block, the binding's config class is one whose `pthrDelay` turns that 0 into `pause_us`. The
    one private name this touches is checked: a NIXL without it keeps its spinning thread, and
    says so."""
    if not pause_us:
        yield
        return
    try:
        from nixl._api import nixlBind as bindings
        base = bindings.nixlAgentConfig
        field = base.pthrDelay
    except (ImportError, AttributeError) as exc:
        logger.warning("%s: NIXL's progress thread keeps polling without pause (this NIXL has no "
                       "nixlAgentConfig.pthrDelay to set: %s)", who, exc)
        yield
        return

    class PacedConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's name
            return field.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            field.__set__(self, value or pause_us)

    bindings.nixlAgentConfig = PacedConfig
    try:
        yield
    finally:
        bindings.nixlAgentConfig = base
    logger.info("%s: NIXL's progress thread pauses %d us between rounds", who, pause_us)
