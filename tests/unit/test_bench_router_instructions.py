"""bench/router_instructions.py: its tables (the callgrind runs themselves are the bench's), and
bench/bytecode_trace.py's counts."""

from __future__ import annotations

import pytest

from bench import router_instructions as ri


def row(ir: float) -> dict:
    return {"requests": 100, "Ir": ir, "I1 misses": ir / 40, "D1 misses": ir / 50,
            "LL misses": 0.0, "est. cycles": ir * 1.5}


def test_rows_carry_their_ratio_to_this_checkout_and_skip_cases_a_router_did_not_run():
    results = {"this checkout": {"vllm_pull": row(400_000), "sglang": row(420_000)},
               "before": {"vllm_pull": row(500_000), "sglang": row(420_000)},
               ri.FLOOR: {"vllm_pull": row(100_000)}}  # the floor proxy runs vLLM's flow only
    lines = ri.table(results)
    assert lines[0].startswith("| case | router | Ir per request |")
    body = lines[2:]
    assert len(body) == 5
    assert body[0] == ("| vllm_pull | this checkout | 400,000 | 10,000 | 8,000 | 0 | 600,000 |")
    assert "| vllm_pull | before | 500,000 (1.25x) |" in body[1]
    assert f"| vllm_pull | {ri.FLOOR} | 100,000 (0.25x) |" in body[2]
    assert not any(line.startswith(f"| sglang | {ri.FLOOR}") for line in body)
    assert "| sglang | before | 420,000 (1.00x) |" in body[4]


@pytest.mark.processes
def test_the_tracer_counts_each_functions_bytecodes_and_calls_exactly(tmp_path):
    """bench/bytecode_trace.py over a module of known work: a function called 3 times after the
    counts were zeroed is counted 3 times, its bytecodes a whole number per call and as many as
    its loop needs, and the work before the zeroing is not in the counts."""
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "work.py").write_text(
        "import os, signal, sys, time\n"
        "def step(n):\n"
        "    total = 0\n"
        "    for i in range(n):\n"
        "        total += i\n"
        "    return total\n"
        "step(10)\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"  # zero: step(10) above is not counted
        "for _ in range(3):\n"
        "    step(5)\n"
        "os.kill(os.getpid(), signal.SIGUSR2)\n"
        "sys.stdout.write('done')\n")
    out = tmp_path / "counts.json"
    env = {**os.environ, "PD_BYTECODES_OUT": str(out), "PYTHONPATH": str(tmp_path),
           "PYTHONSAFEPATH": "1"}
    tracer = str(ri.common.ROOT / "bench" / "bytecode_trace.py")
    done = subprocess.run([sys.executable, tracer, "work"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout == "done", done.stderr
    counts = json.loads(out.read_text())
    (ops, calls), = [v for k, v in counts.items() if k.endswith(":2:step")]
    assert calls == 3
    once = ops / 3
    assert once == int(once) and 5 * 3 < once < 200  # the loop's 5 rounds, a few bytecodes each


def test_bytecode_tables_group_by_file_and_list_this_checkouts_functions():
    pd = "/x/pd_plugins/routers/"
    results = {"this checkout": {"vllm_pull": {f"{pd}proxy.py:10:Proxy._run": [300.0, 3.0],
                                               f"{pd}http_client.py:5:_Conn.on_header": [100.0, 8.0],
                                               f"{pd}proxy.py:90:Proxy._finish": [60.0, 1.0]}},
               ri.FLOOR: {"vllm_pull": {"/x/bench/floor_proxy.py:1:Front.on_url": [40.0, 1.0]}}}
    text = "\n".join(ri.bytecode_tables(results))
    assert "bytecodes per request this checkout 460, " in text
    assert "| pd_plugins/routers/proxy.py | 360 (78%) | 0 (0%) |" in text
    assert "| `Proxy._run` (pd_plugins/routers/proxy.py:10) | 300 | 3.00 | 100 |" in text
    assert text.index("Proxy._run") < text.index("_Conn.on_header") < text.index("Proxy._finish`")
