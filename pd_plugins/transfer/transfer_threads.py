"""The threads a transfer library starts in an engine's process: their priority, and how often
NIXL's progress thread wakes.

NIXL's progress thread polls without pause (its Python API fixes the delay, `pthrDelay`, at 0) and
starts on the engine's own core: on a CPU engine the kernel then shared that core half and half
between it and the model, and a 448-token prefill of tiny-qwen3-moe took 33.4 ms instead of 14.3 ms
(engine side, a one-off measurement; docs/connectors.md). Two remedies, each an option
(transfer/options.py), both defaults on a CPU engine:

- `lowered_new_threads`: the threads NIXL starts run at nice 19, so they run whenever the model
  waits.
- `paced_progress`: the progress thread waits for work. NIXL's `pthrDelay` is how long the
  thread's poll for UCX events may block (whole milliseconds, rounded up); an event wakes it at
  once, so a transfer does not wait for the timeout. Nice alone left an idle PD pair keeping both
  cores of this machine busy (each server is its own session, and the kernel shares a core
  between sessions before nice values count): servers started beside it came up late, and the
  engines' own API servers answered /metrics seconds late under test load (docs/connectors.md,
  "Under load", has the counts). With a 1 ms wait an idle agent's progress thread wakes about
  1000 times a second and uses 2-3% of a core instead of 100%.

Used by both engines' NIXL adapters around the call that creates their agents. Engine-agnostic:
the standard library, NIXL and transfer/options.py (Linux; elsewhere nothing is changed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
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


_SWAP = threading.Lock()  # one swap of NIXL's config class at a time


@contextlib.contextmanager
def paced_progress(wait_us: int | None, who: str) -> Iterator[None]:
    """NIXL agents created inside the block have a progress thread that blocks up to `wait_us`
    (rounded up to whole ms by NIXL) waiting for UCX events, instead of polling without pause
    (None or 0: as upstream). NIXL's `nixl_agent` builds its C++ config itself and sets
    `pthrDelay = 0`; for the block, the binding's config class is one whose `pthrDelay` turns that
    0 into `wait_us`. That private name is checked: a NIXL without it, or one that no longer sets
    it, keeps its spinning thread, and the log says so."""
    if not wait_us:
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
    applied = []

    class PacedConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's name
            return field.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            applied.append(value or wait_us)
            field.__set__(self, value or wait_us)

    with _SWAP:
        bindings.nixlAgentConfig = PacedConfig
        try:
            yield
        finally:
            bindings.nixlAgentConfig = base
    if applied:
        logger.info("%s: NIXL's progress thread waits up to %d us for work", who, applied[-1])
    else:
        logger.warning("%s: no NIXL agent set pthrDelay while it was created; its progress thread "
                       "may poll without pause", who)
