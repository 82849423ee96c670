"""The ws64 KV digest's cost per GB on this machine (transfer/kv_digest.py), beside what reading
the same bytes costs otherwise: the shm pool's plain sum and a memcpy. Prints a markdown table;
the numbers live in docs/plans/kv-verification.md §3 (a one-off primitive cost, not an engine
benchmark: bench/kv_verify.py, still to be written, measures verification in the engines).

    taskset -c 1 nice -n 5 env OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 \\
        .venv/bin/python -m bench.kv_digest [--repeats 11]

Buffers: kv-llama's layout (bench/kv_transfer.py's model: 1 MiB of KV per 32-token block of all
layers), 14 MiB (a 448-token prompt) "warm" (the same bytes each time, in cache) and "cold"
(rotating over disjoint sets of a 512 MiB buffer), and 64 MiB whole.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from bench.common import machine
from pd_plugins.transfer.kv_digest import block_digests, torch_block_digests
from pd_plugins.transfer.shm_pool import row_checksums

MIB = 1 << 20
LAYERS = 16  # kv-llama: a 1 MiB block is 16 layers of 64 KiB


def timed(fn, sets: list, repeats: int) -> list[float]:
    fn(sets[0])  # warm-up (numba compiles or loads its cache here)
    out = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(sets[i % len(sets)])
        out.append(time.perf_counter() - start)
    return out


def layered(rows: np.ndarray) -> list[np.ndarray]:
    """[blocks, 1 MiB] as kv-llama's 16 layer views of [blocks, 64 KiB] (paged by block)."""
    width = rows.shape[1] // LAYERS
    return [rows[:, i * width:(i + 1) * width] for i in range(LAYERS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    big = rng.integers(0, 255, 512 * MIB, dtype=np.uint8).reshape(512, MIB)
    sets = {"14 MiB warm": [big[:14]], "14 MiB cold": [big[i:i + 14] for i in range(0, 504, 14)],
            "64 MiB": [big[i:i + 64] for i in range(0, 512, 64)]}
    cases = {
        "ws64 (numba, per block of 16 layers)": lambda rows: block_digests(
            layered(rows), range(rows.shape[0])),
        "ws64 (numba, per block as one 1 MiB row)": lambda rows: block_digests(
            [rows], range(rows.shape[0])),
        "plain u64 sum per block (the pool's checksum)": lambda rows: row_checksums(rows),
        "memcpy (for scale)": lambda rows: np.copyto(scratch[:rows.shape[0]], rows),
        "ws64 torch on CPU (the GPU formula)": lambda rows: torch_block_digests(
            [torch.from_numpy(np.ascontiguousarray(v)) for v in layered(rows)],
            range(rows.shape[0])),
    }
    scratch = np.empty((64, MIB), np.uint8)
    print(f"{machine()}; load average {os.getloadavg()}; {args.repeats} repeats, median "
          f"(min-max)\n")
    print("| case | buffer | ms median (min-max) | ms/GB |")
    print("|---|---|---|---|")
    for name, fn in cases.items():
        for label, chosen in sets.items():
            if name.startswith("ws64 torch") and label != "14 MiB warm":
                continue  # ~10x slower: one case tells it
            times = timed(fn, chosen, args.repeats)
            mib = chosen[0].shape[0]
            med = statistics.median(times) * 1e3
            print(f"| {name} | {label} | {med:.3f} ({min(times) * 1e3:.3f}-"
                  f"{max(times) * 1e3:.3f}) | {med / (mib / 1024):.0f} |")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
