"""The lowest priority for the threads a transfer library starts in an engine's process.

NIXL's progress thread polls without pause (its Python API fixes the delay at 0) and starts on the
engine's own core: on a CPU engine the kernel then shared that core half and half between it and
the model, and a 448-token prefill of tiny-qwen3-moe took 33.4 ms instead of 14.3 ms (engine side,
a one-off measurement; docs/connectors.md). At nice 19 the thread still runs whenever the model
waits. Used by both engines' NIXL adapters around the call that creates their agents.

Engine-agnostic: the standard library and transfer/options.py (Linux; elsewhere nothing is
changed).
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
