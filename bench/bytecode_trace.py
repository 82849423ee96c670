"""Run a Python module as its process's main program, counting the bytecodes each function executes.

    python bench/bytecode_trace.py MODULE [ARGS...]     # e.g. pd_plugins.routers --port 8000 ...

SIGUSR1 zeroes the counts, SIGUSR2 writes them to $PD_BYTECODES_OUT as JSON:
{"FILE:LINE:QUALNAME": [bytecodes, calls]} (a coroutine's resumptions count as calls). Used by
bench/router_instructions.py --bytecodes. The count of what ran is exact, and load changes
little of what runs (how the bytes arrive in reads, timers: runs agree within about 2%); the
tracer makes the process about 30 times slower, so time nothing under it. Only the main thread
is traced (the router's event loop), and only Python: what C code (httptools, msgspec, uvloop,
the kernel) does for a call is not in these counts.

Run as a file, not with -m: with PYTHONSAFEPATH set, PYTHONPATH alone decides which checkout's
MODULE runs (bench/router_instructions.py --tree).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
from collections import Counter
from types import CodeType, FrameType

bytecodes: Counter[CodeType] = Counter()
calls: Counter[CodeType] = Counter()


def _per_opcode(frame: FrameType, event: str, arg: object):
    if event == "opcode":
        bytecodes[frame.f_code] += 1
    return _per_opcode


def _on_call(frame: FrameType, event: str, arg: object):
    frame.f_trace_opcodes = True
    calls[frame.f_code] += 1
    return _per_opcode


def _zero(*_: object) -> None:
    bytecodes.clear()
    calls.clear()


def _write(*_: object) -> None:
    out: dict[str, list[int]] = {}
    for code, n in list(bytecodes.items()):
        key = f"{code.co_filename}:{code.co_firstlineno}:{code.co_qualname}"
        ops, called = out.get(key, (0, 0))  # (several code objects may share a name: lambdas)
        out[key] = [ops + n, called + calls.get(code, 0)]
    path = os.environ["PD_BYTECODES_OUT"]
    with open(f"{path}.part", "w") as f:  # whole or not at all for the reader
        json.dump(out, f)
    os.replace(f"{path}.part", path)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    signal.signal(signal.SIGUSR1, _zero)
    signal.signal(signal.SIGUSR2, _write)
    module, sys.argv = sys.argv[1], sys.argv[1:]
    sys.settrace(_on_call)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
