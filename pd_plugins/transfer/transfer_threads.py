"""The lowest priority for the threads a transfer library starts in an engine's process.

NIXL's progress thread polls without pause (its Python API fixes the delay at 0) and starts on the
engine's own core: on a CPU engine the kernel then shared that core half and half between it and
the model, and a 448-token prefill of tiny-qwen3-moe took 33.4 ms instead of 14.3 ms (engine side,
a one-off measurement; docs/connectors.md). At nice 19 the thread still runs whenever the model
waits. Used by both engines' NIXL adapters around the call that creates their agents.

Engine-agnostic: the standard library only (Linux; elsewhere nothing is changed).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

logger = logging.getLogger("pd_plugins")

DEFAULT_NICE = 19
ENV = "PD_TRANSFER_THREADS_NICE"  # engines without a connector config (SGLang): a number, or "none"


def thread_ids() -> set[int]:
    """This process's threads (Linux; empty elsewhere)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def nice_from_env(default: int | None = DEFAULT_NICE) -> int | None:
    """The nice value for transfer threads from PD_TRANSFER_THREADS_NICE ("none": leave them)."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return default
    if value in ("none", "null", "off"):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{ENV} must be a nice value (0-19) or 'none', not {value!r}") from None


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
