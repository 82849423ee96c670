"""bench/router_instructions.py: its table (the callgrind runs themselves are the bench's)."""

from __future__ import annotations

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
