"""Shared-memory KV pool bandwidth: how fast `ShmKVPool` (pd_plugins/transfer/shm_pool.py) moves KV
blocks into and out of its region, against a plain memcpy of the same bytes in the same run.

    .venv/bin/python -m bench.shm_pool_bandwidth            # ~6 minutes
    .venv/bin/python -m bench.shm_pool_bandwidth --quick    # a smoke run of a few seconds
    .venv/bin/python -m bench.shm_pool_bandwidth --render   # docs and plot from the saved JSON

Why: the pool is PdShmConnector's transport (a prefill writes KV blocks into it, a decode copies
them out), so its header work (a file lock per call), its per-batch Python and its checksums must
cost little next to the copy itself. Target: pool write and read, with and without checksums, at
90% of memcpy or more for blocks of 64 KiB and up.

What, for each block (slot) size, over a fixed number of bytes per repetition (64 MiB: twice the
L3 cache, and every pass starts with the caches flushed, so the copies go to memory), in batches
of 32 blocks per pool call (a connector's calls per request):
- memcpy: `np.copyto` block by block between two private, pre-touched arrays (the baseline);
- write: reserve a batch, `write_many` (each block copied and summed in one pass by the compiled
  `copy_rows`, whose stores bypass the caches), publish the batch;
- write, no checksums: the same into a pool created with `checksums=False` (the same copies, the
  sums neither kept nor checked);
- read: pin a batch, `read_many` (the same one-pass copies out, each block's sum checked against
  the pin's checksum), unpin the batch (the generation check);
- read, no checksums: the same from a pool created with `checksums=False`;
- read, other process: the read with checksums in a second process that maps the pool itself (a
  decode engine reading what a prefill wrote), timed inside that process;
- two references for the breakdown: the pool's copies alone (`copy_runs`, as `write_many` and
  `read_many` call it) into the pool's slots and out of them, with no pool calls.
One warm-up repetition, then the timed ones; every repetition runs each (case, block size) once,
in a shuffled order, so the machine's noise hits all of them alike. GB/s is 1e9 bytes per second
of wall time; a ratio is memcpy time / case time within one repetition, its median taken over
repetitions. Each pass also records its process's CPU time (the same ratios from it are not
inflated by other processes' time slices), the time spent in the locked calls, and page faults.

Setup records what mapping a pool costs: creating each read pool (`_prefault` maps every page
then) and mapping it again in the other process, with their page faults, and the first pass over
each.

Then a short diagnostics pass times what the pool does besides copying: the per-call cost of
`write`, `read`, `write_many` and `read_many` on a batch of tiny blocks, `checksum`, `np.copyto` and
a `flock` pair; the locked calls per key on full pools of 256 to 65536 slots, next to a `lookup`
of a batch there; and, between private arrays, np.copyto against the one-pass copy and sum with
ordinary stores and with the pool's non-temporal ones: why `copy_rows` stores around the caches.

Writes bench/results/shm_pool_bandwidth.json, docs/img/shm_pool_bandwidth.png and the
"Shared-memory KV pool bandwidth" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import functools
import hashlib
import json
import mmap
import multiprocessing as mp
import os
import platform
import random
import resource
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np

from bench import common
from pd_plugins.transfer.shm_pool import (
    MADV_POPULATE_WRITE, ShmKVPool, checksum, copy_runs, pool_geometry, remove_pool)

KiB, MiB = 1 << 10, 1 << 20
BLOCK_SIZES = (16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
# Blocks per reserve/publish/pin/unpin call: one request's blocks, as PdShmConnector calls the
# pool (a 2048-token prefill chunk at vLLM's default block size of 16 tokens).
BATCH = 128
TARGET, TARGET_FROM = 0.9, 64 * KiB
CASES = {  # name -> label; memcpy first: the baseline
    "memcpy": "memcpy (np.copyto)",
    "write": "pool write",
    "write_plain": "pool write, no checksums",
    "read": "pool read",
    "read_plain": "pool read, no checksums",
    "read_xproc": "pool read, other process",
}
TARGET_CASES = ("write", "write_plain", "read", "read_plain")
SHORT = {"write": "write", "write_plain": "write plain", "read": "read", "read_plain": "read plain"}
REGION_CASES = {  # references, not in the main table: the copies alone, without the pool's calls
    "region_in": "the pool's copy into pool slots",
    "region_out": "the pool's copy out of pool slots",
}
ALL_CASES = {**CASES, **REGION_CASES}
SHM = "/dev/shm"
PAGE = 4096
RESULTS = common.RESULTS / "shm_pool_bandwidth.json"
perf = time.perf_counter


def size_name(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def layout(block: int) -> str:
    return f"bench/shm_pool_bandwidth {block}-byte blocks"


def make_keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest() for i in range(n)]


def batches(n: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + BATCH, n)) for lo in range(0, n, BATCH)]


def require(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(what)


def touched(nbytes: int, seed: int | None = None) -> np.ndarray:
    """A private, page-aligned array with every page mapped: random bytes (checksums mean
    something), or ones. Aligned like the pool's slots and like an engine's KV cache tensors:
    numpy's own arrays start 16 bytes past a cache line, and a copy between buffers misaligned
    against each other runs up to twice as slow here for blocks of 16-256 KiB, which would be
    counted against the pool."""
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE
    out = raw[start:start + nbytes]
    out[:] = 1 if seed is None else np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8)
    return out


def region_for(slots: int, slot_bytes: int) -> int:
    """The smallest region that holds `slots` slots: the pool then has exactly that many."""
    lo, hi = slots * slot_bytes, slots * (slot_bytes + 4096) + 8 * 4096
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pool_geometry(mid, slot_bytes)[1] >= slots else (mid + 1, hi)
    return lo


def timed_open(**kwargs) -> tuple[ShmKVPool, dict]:
    """Open (or create) a pool, timing it: with `prefault` on, every page is mapped here."""
    faults, start = minor_faults(), perf()
    pool = ShmKVPool(**kwargs)
    return pool, {"s": perf() - start, "faults": minor_faults() - faults}


def open_pool(stack: contextlib.ExitStack, name: str, slots: int, slot_bytes: int,
              checksums: bool = True) -> tuple[ShmKVPool, dict]:
    """A fresh pool of exactly `slots` slots on /dev/shm, closed and deleted when `stack` exits,
    and what creating it cost (seconds, minor page faults)."""
    path = f"{SHM}/pd-bench-shm-{os.getpid()}-{name}"
    remove_pool(path)  # left by a killed run whose process had this PID
    stack.callback(remove_pool, path)  # registered first: runs last, even if the open fails
    pool, opened = timed_open(path=path, slot_bytes=slot_bytes, layout=layout(slot_bytes),
                              size_bytes=region_for(slots, slot_bytes), checksums=checksums)
    stack.callback(pool.close)
    require(pool.num_slots == slots, f"{path}: {pool.num_slots} slots, wanted {slots}")
    require(pool.checksums == checksums, f"{path}: checksums {pool.checksums}, wanted {checksums}")
    return pool, opened


# -- one pass over a repetition's bytes; each returns the seconds spent in the pool's locked calls --
def memcpy_pass(src: np.ndarray, dst: np.ndarray) -> float:
    for i in range(len(src)):
        np.copyto(dst[i], src[i])
    return 0.0


def pool_copy_pass(src: np.ndarray, dst: np.ndarray) -> float:
    """The pool's copies alone (as write_many and read_many make them, summing), no pool calls."""
    for lo, hi in batches(len(src)):
        copy_runs(src, range(lo, hi), dst, range(lo, hi), sum_source=True)
    return 0.0


def write_pass(pool: ShmKVPool, keys: list[bytes], src: np.ndarray) -> float:
    locked = 0.0
    for lo, hi in batches(len(keys)):
        t0 = perf()
        refs = pool.reserve(keys[lo:hi])
        t1 = perf()
        require(bool((refs.slots >= 0).all()), "reserve found no slot: the pool is too small")
        sums = pool.write_many(refs, src[lo:hi])
        t2 = perf()
        published = pool.publish_many(refs, sums, src.shape[1])
        locked += (t1 - t0) + (perf() - t2)
        require(bool(published.all()), "publish failed")
    return locked


def read_pass(pool: ShmKVPool, keys: list[bytes], dst: np.ndarray) -> float:
    """Pin, copy out (checked against the pins' checksums in a pool with checksums), unpin."""
    locked = 0.0
    for lo, hi in batches(len(keys)):
        t0 = perf()
        pins = pool.pin(keys[lo:hi])
        locked += perf() - t0
        require(bool((pins.slots >= 0).all()), "a published block is missing from the pool")
        require(all(pool.read_many(pins, dst[lo:hi])), "bad checksum in a slot")
        t0 = perf()
        intact = pool.unpin(pins)
        locked += perf() - t0
        require(all(intact), "a slot changed while it was pinned")
    return locked


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def last_level_cache_bytes(default: int = 32 * MiB) -> int:
    caches = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes = {}
    for index in caches.glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            size = (index / "size").read_text().strip()
            sizes[int((index / "level").read_text())] = int(size.rstrip("KM")) * (
                MiB if size.endswith("M") else KiB)
    return sizes[max(sizes)] if sizes else default


@functools.cache
def _scratch() -> np.ndarray:
    return touched(3 * last_level_cache_bytes()).view(np.uint64)


def evict_caches() -> None:
    """Read three times the last-level cache, so that no pass starts with its data cached (the
    memcpy baseline's arrays are touched by more cases than any one pool is)."""
    _scratch().sum()


def measure(body, *args) -> dict:
    """Time one pass from cold caches: wall seconds, this process's CPU seconds (what other
    processes' time slices do not inflate), seconds in locked pool calls, minor page faults."""
    evict_caches()
    faults = minor_faults()
    cpu, start = time.process_time(), perf()
    locked = body(*args)
    seconds, cpu = perf() - start, time.process_time() - cpu
    return {"s": seconds, "cpu_s": cpu, "lock_s": locked, "faults": minor_faults() - faults}


# -- the cases --------------------------------------------------------------------------------------
@dataclass
class Blocks:
    """One block size: the private source and destination, pools to write into (one repetition
    fills one exactly, so each repetition evicts the previous one's blocks, never its own) and
    pools of published blocks to read; each with checksums and without."""

    block: int
    src: np.ndarray  # [n, block] views of the shared private arrays
    dst: np.ndarray
    write_pool: ShmKVPool
    write_pool_plain: ShmKVPool  # checksums=False
    read_pool: ShmKVPool
    read_pool_plain: ShmKVPool   # checksums=False
    read_keys: list[bytes]
    opened: dict       # creating the read pool (with checksums): the prefault's cost
    first_write: dict  # the pass that filled that pool: the first write into a fresh pool

    @property
    def n(self) -> int:
        return len(self.src)


def setup_blocks(stack: contextlib.ExitStack, block: int, src: np.ndarray,
                 dst: np.ndarray) -> Blocks:
    n = src.size // block
    rows_src, rows_dst = src.reshape(n, block), dst.reshape(n, block)
    read_keys = make_keys(f"read:{block}", n)
    read_pool, opened = open_pool(stack, f"read-{block}", n, block)
    first_write = measure(write_pass, read_pool, read_keys, rows_src)
    read_pool_plain, _ = open_pool(stack, f"read-plain-{block}", n, block, checksums=False)
    write_pass(read_pool_plain, read_keys, rows_src)
    return Blocks(block, rows_src, rows_dst,
                  open_pool(stack, f"write-{block}", n, block)[0],
                  open_pool(stack, f"write-plain-{block}", n, block, checksums=False)[0],
                  read_pool, read_pool_plain, read_keys, opened, first_write)


def reader_process(conn, specs: list[tuple[int, str, list[bytes]]], total: int) -> None:
    """The other process: maps each read pool itself (timing that), then times one read pass per
    request."""
    pools, opened = {}, {}
    for block, path, keys in specs:
        pool, opened[block] = timed_open(path=path, slot_bytes=block, layout=layout(block))
        pools[block] = (pool, keys)
    dst = touched(total)
    try:
        require(all(pool.checksums for pool, _ in pools.values()), "a read pool lost its checksums")
        conn.send(("ready", opened))
        while (block := conn.recv()) is not None:
            pool, keys = pools[block]
            conn.send(measure(read_pass, pool, keys, dst.reshape(-1, block)))
    except EOFError:
        pass  # the benchmark went away
    finally:
        for pool, _ in pools.values():
            pool.close()


class OtherProcessReader:
    """A spawned process that reads the pools on request (a start/stop handshake over a pipe)."""

    def __init__(self, blocks: list[Blocks], total: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        specs = [(b.block, b.read_pool.path, b.read_keys) for b in blocks]
        self.proc = ctx.Process(target=reader_process, args=(child, specs, total), daemon=True)
        self.proc.start()
        child.close()
        ready, self.opened = self.conn.recv()
        require(ready == "ready", "the reader process did not start")

    def read(self, block: int) -> dict:
        self.conn.send(block)
        return self.conn.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


def run_case(case: str, b: Blocks, rep: int, reader: OtherProcessReader) -> dict:
    if case == "memcpy":
        return measure(memcpy_pass, b.src, b.dst)
    if case == "region_in":  # over the write pool's slots: nobody reads them, the next write redoes them
        return measure(pool_copy_pass, b.src, b.write_pool.data)
    if case == "region_out":
        return measure(pool_copy_pass, b.read_pool.data, b.dst)
    if case == "write":
        return measure(write_pass, b.write_pool, make_keys(f"write:{b.block}:{rep}", b.n), b.src)
    if case == "write_plain":
        return measure(write_pass, b.write_pool_plain, make_keys(f"write:{b.block}:{rep}", b.n),
                       b.src)
    if case == "read":
        return measure(read_pass, b.read_pool, b.read_keys, b.dst)
    if case == "read_plain":
        return measure(read_pass, b.read_pool_plain, b.read_keys, b.dst)
    if case == "read_xproc":
        return reader.read(b.block)
    raise ValueError(case)


def progress_line(rep: int, reps: int, seconds: float, passes: dict) -> str:
    """The last repetition's pool/memcpy ratios of the target cases, per block size."""
    head = "warm-up" if rep == 0 else f"rep {rep}/{reps}"
    cells = []
    for block in BLOCK_SIZES:
        base = passes["memcpy"][block][-1]["s"]
        ratios = "/".join(f"{base / passes[c][block][-1]['s']:.2f}" for c in TARGET_CASES)
        cells.append(f"{size_name(block)} {ratios}")
    names = "/".join(SHORT[c] for c in TARGET_CASES)
    return f"{head} ({seconds:.1f} s): {names} vs memcpy: " + ", ".join(cells)


# -- diagnostics: what the pool does besides copying --------------------------------------------------
def per_call_us(fn, calls: int = 2000, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = perf()
        for _ in range(calls):
            fn()
        best = min(best, (perf() - start) / calls)
    return best * 1e6


def call_overheads(stack: contextlib.ExitStack) -> dict:
    """Per-call cost on 64-byte blocks: Python and numpy overhead, next to no copying. The batched
    calls move BATCH blocks in consecutive slots, in a pool with checksums and one without."""
    out = {}
    for checksums, suffix in ((True, ""), (False, ", no checksums")):
        pool, _ = open_pool(stack, f"diag-calls-{int(checksums)}", 2 * BATCH, 64, checksums)
        keys = make_keys("diag-calls", 2 * BATCH)
        refs = pool.reserve(keys)
        require([r.slot for r in refs] == list(range(2 * BATCH)), "diag: slots not consecutive")
        to_write, to_read = refs[:BATCH], refs[BATCH:]
        rows, dst = np.ones((BATCH, 64), dtype=np.uint8), np.empty((BATCH, 64), dtype=np.uint8)
        sums = pool.write_many(to_read, rows)
        require(bool(pool.publish_many(to_read, sums, 64).all()), "publish failed")
        pinned = pool.pin(keys[BATCH:])
        require(all(pool.read_many(pinned, dst)), "bad checksum")
        out[f"ShmKVPool.write_many{suffix}"] = per_call_us(lambda: pool.write_many(to_write, rows),
                                                           calls=500)
        out[f"ShmKVPool.read_many{suffix}"] = per_call_us(lambda: pool.read_many(pinned, dst),
                                                          calls=500)
        if checksums:
            data, one = rows[0], dst[0]
            out["ShmKVPool.write"] = per_call_us(lambda: pool.write(to_write[0], data))
            out["ShmKVPool.read"] = per_call_us(lambda: pool.read(pinned[0]))
            out["checksum"] = per_call_us(lambda: checksum(data))
            out["np.copyto"] = per_call_us(lambda: np.copyto(one, data))
            fd = os.open(pool.path, os.O_RDWR)
            stack.callback(os.close, fd)
            out["flock pair"] = per_call_us(lambda: (fcntl.flock(fd, fcntl.LOCK_EX),
                                                     fcntl.flock(fd, fcntl.LOCK_UN)))
    return out


@numba.njit(nogil=True)
def copy_rows_cached(src, dst, sums):
    """The pool's one-pass copy and sum with ordinary stores (for comparison with copy_rows)."""
    for j in range(src.shape[0]):
        a, b = src[j], dst[j]
        total = np.uint64(0)
        for w in range(src.shape[1]):
            x = a[w]
            b[w] = x
            total += x
        sums[j] = total


def cached_pass(src: np.ndarray, dst: np.ndarray) -> float:
    copy_rows_cached(src.view(np.uint64), dst.view(np.uint64), np.zeros(len(src), dtype=np.uint64))
    return 0.0


# np.copyto, the one-pass copy and sum with ordinary stores, the pool's (non-temporal stores)
STORES = {"np.copyto": memcpy_pass, "cached": cached_pass, "streaming": pool_copy_pass}


def store_sweep(blocks: list[Blocks], runs: int) -> dict:
    """Between private arrays, each of STORES as a ratio to np.copyto (median of `runs` passes
    from cold caches, the variants interleaved)."""
    for b in blocks:  # compile outside the timing
        copy_rows_cached(b.src[:1].view(np.uint64), b.dst[:1].view(np.uint64), np.zeros(1, np.uint64))
    times = {(v, b.block): [] for b in blocks for v in STORES}
    for _ in range(runs):
        for b in blocks:
            for v in STORES:
                times[v, b.block].append(measure(STORES[v], b.src, b.dst)["s"])
    return {v: {b.block: statistics.median(times["np.copyto", b.block]) / statistics.median(times[v, b.block])
                for b in blocks} for v in STORES}


def fill(pool: ShmKVPool, tag: str, chunk: int = 4096) -> None:
    """Publish a block in every slot (a pool in service is full), in large calls to be quick."""
    for lo in range(0, pool.num_slots, chunk):
        refs = pool.reserve(make_keys(f"{tag}:{lo}", min(chunk, pool.num_slots - lo)))
        require(bool((refs.slots >= 0).all()), "cannot fill the pool")
        pool.publish_many(refs, np.zeros(len(refs), dtype=np.uint64), 64)


def locked_calls_us(stack: contextlib.ExitStack, slot_counts=(2 * BATCH, 1024, 8192, 65536),
                    rounds: int = 15) -> dict:
    """Microseconds per key in the locked header calls of a full pool, against its slot count:
    reserve + publish of a batch of new keys (evicting), then pin + unpin of that batch. Beside
    them, per call: a `lookup` of the last batch (a locked call that only scans the header, as
    every reserve and pin does), and, as a yardstick, one numpy `==` compare of a u64 column that
    long against one value."""
    out = {}
    rng = np.random.default_rng(2)
    for slots in slot_counts:
        pool, _ = open_pool(stack, f"diag-lock-{slots}", slots, 64)
        fill(pool, f"diag-fill:{slots}")
        write, read = [], []
        for r in range(rounds):
            keys = make_keys(f"diag-lock:{slots}:{r}", BATCH)
            start = perf()
            refs = pool.reserve(keys)
            pool.publish_many(refs, np.zeros(len(refs), dtype=np.uint64), 64)
            mid = perf()
            pool.unpin(pool.pin(keys))
            write.append((mid - start) / BATCH)
            read.append((perf() - mid) / BATCH)
        column = rng.integers(0, 2**63, slots, dtype=np.int64).astype(np.uint64)
        calls = max(5, 20000 // slots)
        out[slots] = {"reserve+publish": statistics.median(write) * 1e6,
                      "pin+unpin": statistics.median(read) * 1e6,
                      "lookup": per_call_us(lambda: pool.lookup(keys), calls=calls),
                      "compare_one": per_call_us(lambda: column == column[0], calls=calls)}
    return out


# -- summary and docs ---------------------------------------------------------------------------------
def spread(values: list[float]) -> dict:
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return {"median": float(p50), "p10": float(p10), "p90": float(p90),
            "min": min(values), "max": max(values)}


def summarize(runs: dict, total: int) -> dict:
    out = {}
    for case, by_block in runs.items():
        out[case] = {}
        for block, passes in by_block.items():
            base = runs["memcpy"][block]
            stats = {"lock_share": statistics.median(p["lock_s"] / p["s"] for p in passes),
                     "lock_us": statistics.median(p["lock_s"] for p in passes) / (total // block) * 1e6,
                     "faults": statistics.median(p["faults"] for p in passes)}
            for clock, suffix in (("s", ""), ("cpu_s", "_cpu")):
                stats["gbps" + suffix] = spread([total / p[clock] / 1e9 for p in passes])
                stats["ratio" + suffix] = spread([m[clock] / p[clock]
                                                  for m, p in zip(base, passes, strict=True)])
            out[case][block] = stats
    return out


def fmt_ratio(r: float) -> str:
    """A ratio to memcpy; a miss that two decimals would round up to the target is cut (not
    rounded) to three, so that it reads as a miss."""
    if r < TARGET and f"{r:.2f}" == f"{TARGET:.2f}":
        return f"{int(r * 1000) / 1000:.3f}"
    return f"{r:.2f}"


def fmt_gbps(s: dict) -> str:
    return f"{s['median']:.2f} ({s['p10']:.2f}–{s['p90']:.2f})"


def table(meta: dict, summary: dict) -> list[str]:
    cols = list(CASES)
    names = ", ".join(SHORT[c] for c in TARGET_CASES)
    lines = ["| block | pool slots | " + " | ".join(f"{CASES[c]} GB/s" for c in cols)
             + f" | ≥ 90% of memcpy ({names}) | ratios by CPU time ({names}) |",
             "|---:|---:|" + "---:|" * len(cols) + "---|---|"]
    for block in meta["block_sizes"]:
        k = str(block)
        cells = [fmt_gbps(summary["memcpy"][k]["gbps"])]
        for c in cols[1:]:
            s = summary[c][k]
            cells.append(f"{fmt_gbps(s['gbps'])}, **{fmt_ratio(s['ratio']['median'])}×**")
        verdict = ", ".join("yes" if summary[c][k]["ratio"]["median"] >= TARGET else "no"
                            for c in TARGET_CASES)
        by_cpu = ", ".join(f"{fmt_ratio(summary[c][k]['ratio_cpu']['median'])}×"
                           for c in TARGET_CASES)
        lines.append(f"| {size_name(block)} | {meta['total_bytes'] // block} | "
                     + " | ".join(cells) + f" | {verdict} | {by_cpu} |")
    return lines


def costs(summary: dict, block: int) -> dict:
    """Where a pool pass's time goes at one block size (medians)."""
    k = str(block)
    memcpy_gbps = summary["memcpy"][k]["gbps"]["median"]
    ratio = {c: summary[c][k]["ratio"]["median"] for c in ALL_CASES if c != "memcpy"}
    memcpy_us = block / 1e3 / memcpy_gbps  # block / 1e3: µs per block at 1 GB/s
    into = {"write": ratio["region_in"], "write_plain": ratio["region_in"],
            "read": ratio["region_out"], "read_plain": ratio["region_out"]}
    return {
        "memcpy_gbps": memcpy_gbps,
        "memcpy_us": memcpy_us,
        "region_in": ratio["region_in"],
        "region_out": ratio["region_out"],
        "write_lock_us": summary["write"][k]["lock_us"],
        "read_lock_us": summary["read"][k]["lock_us"],
        # what checksums cost a pass: 1 - with / without, from the ratios to memcpy
        "write_sum_share": 1 - ratio["write"] / ratio["write_plain"],
        "read_sum_share": 1 - ratio["read"] / ratio["read_plain"],
        # the ratios that the copies alone plus the locked calls predict, in memcpy's time
        # (with checksums, the gap to the measured ratio is what the one-pass sum costs)
        **{f"model_{c}": 1 / (1 / into[c] + summary[c][k]["lock_us"] / memcpy_us)
           for c in TARGET_CASES},
    }


def breakdown(meta: dict, summary: dict) -> list[str]:
    lines = ["| block | memcpy µs/block | locked calls µs/block (write / read) | pool copies into / "
             "out of pool slots, vs memcpy | checksums' share of a write / read |",
             "|---:|---:|---:|---:|---:|"]
    for block in meta["block_sizes"]:
        c = costs(summary, block)
        lines.append(f"| {size_name(block)} | {c['memcpy_us']:.1f} | {c['write_lock_us']:.1f} / "
                     f"{c['read_lock_us']:.1f} | {c['region_in']:.2f}× / {c['region_out']:.2f}× | "
                     f"{c['write_sum_share']:.0%} / {c['read_sum_share']:.0%} |")
    return lines


def fmt_range(values, spec: str = ".1f") -> str:
    values = list(values)
    lo, hi = min(values), max(values)
    return f"{lo:{spec}}" if f"{lo:{spec}}" == f"{hi:{spec}}" else f"{lo:{spec}}–{hi:{spec}}"


def pairs(values: dict, spec: str = ".2f") -> str:
    """'16 KiB a, 64 KiB b, ...' for {block: value}."""
    return ", ".join(f"{size_name(int(b))} {v:{spec}}" for b, v in values.items())


def reading(meta: dict, summary: dict, diag: dict) -> list[str]:
    """The results in words, from the numbers."""
    sizes = meta["block_sizes"]
    big = [b for b in sizes if b >= TARGET_FROM]
    ratio = {(c, b): summary[c][str(b)]["ratio"]["median"] for c in ALL_CASES for b in sizes}

    def verdict(hit: bool) -> list[str]:
        """'case (size ratio, ...)' for each target case, over the sizes that hit or miss."""
        out = []
        for c in TARGET_CASES:
            cells = [f"{size_name(b)} {fmt_ratio(ratio[c, b])}×" for b in big
                     if (ratio[c, b] >= TARGET) == hit]
            if cells:
                out.append(f"{CASES[c]} ({', '.join(cells)})")
        return out

    met, missed = verdict(True), verdict(False)
    by_cpu = {(c, b): summary[c][str(b)]["ratio_cpu"]["median"] for c in TARGET_CASES for b in big}
    differ = [f"{CASES[c]} at {size_name(b)} ({fmt_ratio(by_cpu[c, b])}×)"
              for c in TARGET_CASES for b in big if (by_cpu[c, b] >= TARGET) != (ratio[c, b] >= TARGET)]
    calls, locks = diag["call_us"], diag["locked_calls_us"]
    stores = {v: {int(b): r for b, r in by.items()} for v, by in diag["store_sweep"].items()}
    cost = {b: costs(summary, b) for b in sizes}
    largest = sizes[-1]
    per_batch_largest = min(BATCH, meta["total_bytes"] // largest)

    # the no-checksum ratios against copies alone + locked calls
    model = {(c, b): cost[b][f"model_{c}"] for c in TARGET_CASES for b in sizes}

    def worst(cases) -> float:
        return max(abs(model[c, b] - ratio[c, b]) for c in cases for b in sizes)

    def predicted(case: str) -> str:
        return ", ".join(f"{size_name(b)} {model[case, b]:.2f}/{ratio[case, b]:.2f}" for b in sizes)

    def lock_at(b: int) -> str:
        c = cost[b]
        return (f"{c['write_lock_us']:.1f} / {c['read_lock_us']:.1f} µs per block at "
                f"{size_name(b)} against memcpy's {c['memcpy_us']:.1f} µs")

    # locked calls against the pool size
    counts = sorted(locks, key=int)
    tiny_n, few_n, many_n = counts[0], counts[1], counts[-1]
    per_key = {n: locks[n]["reserve+publish"] + locks[n]["pin+unpin"] for n in counts}
    per_slot_ns = (per_key[many_n] - per_key[few_n]) * BATCH / (int(many_n) - int(few_n)) * 1e3
    lookup, compare = locks[many_n]["lookup"], locks[many_n]["compare_one"]
    slots = [meta["total_bytes"] // b for b in sizes]

    first = meta["first_touch"]
    most_faults = max(s["faults"] for c in CASES for s in summary[c].values())
    steady = {c: [summary[c][str(b)]["gbps"]["median"] for b in sizes] for c in ("write", "read_xproc")}
    xproc_gap = max(abs(ratio["read_xproc", b] - ratio["read", b]) for b in sizes)
    py, named = meta["python"], meta["mmap_names_populate_write"]
    return [
        f"- Target ({'; '.join(CASES[c] for c in TARGET_CASES)}: each at {TARGET:.0%} of "
        f"memcpy or more from {size_name(big[0])} up): "
        + (f"met by {'; '.join(met)}. " if met else "met by no case at any size. ")
        + (f"Missed by {'; '.join(missed)}. " if missed else "No misses. ")
        + (f"By CPU time the verdict differs for {'; '.join(differ)}." if differ
           else "The CPU-time ratios give the same verdicts."),
        "- Without checksums, a pass costs the copies themselves plus the locked calls, a cost "
        "per batch. The pool's copies alone ran at "
        f"{fmt_range((cost[b]['region_out'] for b in sizes), '.2f')}× memcpy out of the slots and "
        f"{fmt_range((cost[b]['region_in'] for b in sizes), '.2f')}× into them; the locked calls "
        f"(reserve + publish for a write, pin + unpin for a read) took {lock_at(sizes[0])}, "
        f"{lock_at(big[0])} and still {lock_at(largest)}, where a pass is one batch of "
        f"{per_batch_largest} blocks. The two together predict the no-checksum ratios to within "
        f"{worst(('write_plain', 'read_plain')):.2f} at every size (predicted/measured, write: "
        f"{predicted('write_plain')}; read: {predicted('read_plain')}).",
        "- Each locked call is one call into a compiled kernel (pd_plugins/transfer/"
        "shm_pool_kernels.py, numba) that walks the batch and the header columns: a lookup is one "
        "pass over the slots probing a small table of the batch's keys; reserve takes free slots "
        "first, in slot order, so a batch lands in consecutive slots and copies as one run, then "
        "the least recently used evictable ones (a selection, not a sort); reserve and pin hand "
        "back arrays (`SlotRefs`, `PinnedSlots`) that `write_many`, `publish_many`, `read_many` "
        f"and `unpin` take as they are. On a full pool (every reserve evicts) of {tiny_n} slots, "
        f"reserve + publish take {locks[tiny_n]['reserve+publish']:.2f} µs per key and pin + unpin "
        f"{locks[tiny_n]['pin+unpin']:.2f} µs, {per_key[tiny_n] * BATCH:.0f} µs for the four calls "
        f"of a batch of {BATCH} in a warm loop. With more slots the scans add about "
        f"{per_slot_ns:.1f} ns per slot to each batch: the four calls take "
        + ", ".join(f"{per_key[n]:.2f}" for n in counts[1:])
        + f" µs per key with {', '.join(counts[1:])} slots; a `lookup` of a batch in a "
        f"{many_n}-slot pool took {lookup:.0f} µs, {lookup / compare:.1f}× one numpy `==` compare "
        f"of a column that long ({compare:.1f} µs). The `flock` lock + unlock pair is "
        f"{calls['flock pair']:.1f} µs, two per batch. The pools above have "
        f"{min(slots)}–{max(slots)} slots. In the passes the same calls cost more than in a warm "
        "loop (the table above): right after a large copy, this machine runs any code several "
        "times slower than warm (caches and TLBs swept), a fixed cost per call that weighs most on "
        "small blocks.",
        f"- The data calls' own Python is small next to that: on a batch of {BATCH} 64-byte "
        f"blocks in consecutive slots, `write_many` costs {calls['ShmKVPool.write_many']:.1f} µs "
        f"({calls['ShmKVPool.write_many, no checksums']:.1f} µs without checksums) and "
        f"`read_many` {calls['ShmKVPool.read_many']:.1f} µs "
        f"({calls['ShmKVPool.read_many, no checksums']:.1f}); a single `write` "
        f"{calls['ShmKVPool.write']:.1f} µs (`checksum` alone {calls['checksum']:.1f} µs, "
        f"`np.copyto` {calls['np.copyto']:.1f} µs).",
        "- With checksums, each block is copied and summed in one pass (the compiled "
        "`copy_rows`: a load, a non-temporal store and an add per 8-byte word), so a checksum costs no second "
        "pass over the data. Checksums took "
        f"{fmt_range((100 * cost[b]['write_sum_share'] for b in big), '.0f')}% of a write's time "
        f"and {fmt_range((100 * cost[b]['read_sum_share'] for b in big), '.0f')}% of a read's "
        f"(per size: write {pairs({b: cost[b]['write_sum_share'] for b in big}, '.0%')}; read "
        f"{pairs({b: cost[b]['read_sum_share'] for b in big}, '.0%')}). The copies alone and the "
        "locked calls predict the checksummed ratios to within "
        f"{worst(('write', 'read')):.2f} (predicted/measured, write: {predicted('write')}; "
        f"read: {predicted('read')}). The other process read at the same ratios as this one to "
        f"within {xproc_gap:.2f}.",
        "- Stores: `copy_rows` writes with non-temporal stores, which go to memory around the "
        "caches (a block is written once and read much later by another process, and an ordinary "
        "store first reads the line it overwrites), then fences once per call. Between private "
        "arrays, block by block from cold caches, the one-pass copy and sum ran at "
        + pairs(stores["cached"], ".2f") + "× np.copyto with ordinary stores and at "
        + pairs(stores["streaming"], ".2f") + "× with non-temporal ones.",
        "- Page faults: `_prefault` maps every page when a process opens a pool, with "
        "`madvise(MADV_POPULATE_WRITE)` ("
        + ("named by this Python's `mmap`" if named else
           f"passed as 23: Python's `mmap` names it only from 3.13, this run has {py}")
        + ("; this kernel takes it" if meta["populate_write_works"] else
           "; this kernel refuses it, so `_prefault` fell back to touching one byte per page")
        + f"). Creating each {size_name(meta['total_bytes'])} read pool took "
        f"{fmt_range((1e3 * f['s'] for f in first['open'].values()), '.0f')} ms with "
        f"{fmt_range((f['faults'] for f in first['open'].values()), '.0f')} minor faults (one "
        "per 4 KiB page, headers included), and mapping it in the other process "
        f"{fmt_range((1e3 * f['s'] for f in first['open_xproc'].values()), '.0f')} ms with "
        f"{fmt_range((f['faults'] for f in first['open_xproc'].values()), '.0f')}: a pool's pages "
        "are faulted in there, before any copy. The first write pass into a fresh pool then took "
        f"{fmt_range((f['faults'] for f in first['write'].values()), '.0f')} minor faults at "
        f"{fmt_range(f['gbps'] for f in first['write'].values())} GB/s (the timed write passes: "
        f"{fmt_range(steady['write'])} GB/s), and the other process's first read "
        f"{fmt_range((f['faults'] for f in first['read_xproc'].values()), '.0f')} at "
        f"{fmt_range(f['gbps'] for f in first['read_xproc'].values())} GB/s (timed: "
        f"{fmt_range(steady['read_xproc'])} GB/s), against the "
        f"{meta['total_bytes'] // PAGE} data pages of a pool; neither pass is in the table (setup "
        "and warm-up). After the warm-up, "
        + ("no case took a minor fault per pass (median)." if most_faults == 0 else
           f"every case took at most {most_faults:.0f} minor fault(s) per pass (median)."),
        "- Environment: /dev/shm is a tmpfs on one NUMA node (no CXL or DAX device on this "
        "machine), so these are DRAM-to-DRAM copies through the same caches. The machine is "
        "shared and noisy: compare ratios (taken within a repetition) rather than absolute GB/s "
        "across runs.",
    ]


def markdown(results: dict) -> str:
    meta, summary, diag = results["meta"], results["summary"], results["diagnostics"]
    quick = " --quick" if meta["quick"] else ""
    lines = [
        "<!-- shm-pool-bandwidth:start -->", "## Shared-memory KV pool bandwidth", "",
        "How fast `ShmKVPool` (pd_plugins/transfer/shm_pool.py, PdShmConnector's transport) moves "
        "KV blocks in and out of its shared-memory region, against a plain memcpy of the same "
        "bytes in the same run. Target: pool write and read, with and without checksums, at 90% "
        "of memcpy or more for blocks of 64 KiB and up.", "",
        "Rerun: `.venv/bin/python -m bench.shm_pool_bandwidth` (`--quick` for a smoke run of a "
        f"few seconds). This run: `bench/shm_pool_bandwidth.py{quick}`, {meta['date']}, "
        f"{meta['wall_min']:.1f} min.", "",
        f"- Machine: {meta['machine']}. Python {meta['python']}, numpy {meta['numpy']}.",
        f"- Pool region: a file on {SHM} ({meta['shm']}); one NUMA node, no CXL device.",
        "- Private buffers are page aligned, like the pool's slots and an engine's KV tensors: "
        "numpy's default arrays start 16 bytes past a cache line, and copies between buffers "
        "misaligned against each other ran up to 2× slower here for 16–256 KiB blocks, which "
        "this benchmark would otherwise have counted against the pool.",
        f"- Method: {size_name(meta['total_bytes'])} per case and repetition, each pass started "
        "with the caches flushed (reading 3× the L3 cache); one pool per block size with exactly "
        f"as many slots as blocks; batches of {meta['batch']} blocks per reserve/publish/pin/unpin "
        "call. memcpy: `np.copyto` block by block between two private pre-touched arrays. "
        "Write: reserve, `write_many` (each block copied and summed in one pass), publish; each "
        "repetition writes new keys, evicting the previous repetition's blocks. Read: pin, "
        "`read_many` (the same one-pass copies out, each block's sum checked against the pin's "
        "checksum), unpin (the generation check). \"No checksums\": the same calls on pools "
        "created with `checksums=False`, which make the same copies but neither keep nor check the "
        "sums. \"Other process\": the read with checksums in a second (spawned) process "
        "that maps the pool itself and times its own passes. One warm-up repetition, "
        f"then {meta['repeats']}, the cases shuffled within each so that noise hits all alike.",
        "- Cells: median GB/s (1e9 bytes/s, wall clock) with the p10–p90 range in brackets; in "
        "bold the median over repetitions of pool/memcpy (memcpy time / pool time of the same "
        "repetition). The last column takes the same ratios from each process's CPU time, which "
        "other processes' time slices on this shared machine do not inflate (their use of the "
        "memory bus still does).",
        "",
        *table(meta, summary), "",
        "Where the time goes (medians): the time per block in the locked calls (reserve + "
        "publish, pin + unpin) next to memcpy's; the pool's copies alone (`copy_runs` "
        "into the write pool's slots and out of the read pool's, no pool calls); and the share of a pass that checksums cost (1 − with / without, "
        "from the ratios to memcpy).", "",
        *breakdown(meta, summary), "",
        "![shared-memory KV pool bandwidth](img/shm_pool_bandwidth.png)", "",
        "Reading:", "",
        *reading(meta, summary, diag), "",
        "<!-- shm-pool-bandwidth:end -->",
    ]
    return "\n".join(lines) + "\n"


def render() -> int:
    results = json.loads(RESULTS.read_text())
    common.write_section("shm-pool-bandwidth", markdown(results))
    py = common.plot_python()
    if py is not None:
        subprocess.run([str(py), str(common.ROOT / "bench" / "shm_pool_bandwidth_plot.py"),
                        str(RESULTS), str(common.IMG)], check=True)
    print("wrote docs/benchmarks.md and docs/img/shm_pool_bandwidth.png")
    return 0


# -- the run ------------------------------------------------------------------------------------------
def shm_description() -> str:
    st = os.statvfs(SHM)
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    fs = next((m[2] for m in mounts if len(m) > 2 and m[1] == SHM), "?")
    return f"{fs}, {st.f_blocks * st.f_frsize / 2**30:.0f} GiB"


def populate_write_works() -> bool:
    """Whether this kernel takes MADV_POPULATE_WRITE (what `_prefault` asks for first)."""
    with mmap.mmap(-1, PAGE) as probe:
        try:
            probe.madvise(getattr(mmap, "MADV_POPULATE_WRITE", MADV_POPULATE_WRITE))
        except OSError:
            return False
    return True


def measure_all(total: int, reps: int, quick: bool) -> dict:
    rng = random.Random(1)
    passes = {c: {b: [] for b in BLOCK_SIZES} for c in ALL_CASES}  # [0]: the warm-up
    with contextlib.ExitStack() as stack:
        print(f"setting up: {size_name(total)} per case, pools on {SHM}", flush=True)
        src, dst = touched(total, seed=0), touched(total)
        blocks = [setup_blocks(stack, block, src, dst) for block in BLOCK_SIZES]
        reader = OtherProcessReader(blocks, total)
        stack.callback(reader.close)
        for rep in range(reps + 1):
            started = perf()
            jobs = [(case, b) for case in ALL_CASES for b in blocks]
            rng.shuffle(jobs)
            for case, b in jobs:
                passes[case][b.block].append(run_case(case, b, rep, reader))
            print(progress_line(rep, reps, perf() - started, passes), flush=True)
        print("diagnostics: per-call costs, locked calls vs pool size, stores",
              flush=True)
        diagnostics = {"call_us": call_overheads(stack),
                       "locked_calls_us": locked_calls_us(stack),
                       "store_sweep": store_sweep(blocks, 3 if quick else 7)}
    return {"runs": {c: {b: p[1:] for b, p in by.items()} for c, by in passes.items()},
            "warmup": {c: {b: p[0] for b, p in by.items()} for c, by in passes.items()},
            "first_touch": {"open": {b.block: b.opened for b in blocks},
                            "open_xproc": reader.opened,
                            "write": {b.block: b.first_write for b in blocks},
                            "read_xproc": {b: p[0] for b, p in passes["read_xproc"].items()}},
            "diagnostics": diagnostics}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repetitions (default 61, with --quick 5)")
    parser.add_argument("--render", action="store_true", help="docs and plot from the saved JSON")
    args = parser.parse_args()
    if args.render:
        return render()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the pools are removed
    started = time.monotonic()
    total = (32 if args.quick else 64) * MiB
    reps = args.repeats if args.repeats is not None else (5 if args.quick else 61)
    measured = measure_all(total, reps, args.quick)
    runs = measured["runs"]
    meta = {"date": dt.date.today().isoformat(), "machine": common.machine(), "quick": args.quick,
            "python": platform.python_version(), "numpy": np.__version__, "shm": shm_description(),
            "total_bytes": total, "batch": BATCH, "repeats": reps, "block_sizes": list(BLOCK_SIZES),
            "mmap_names_populate_write": hasattr(mmap, "MADV_POPULATE_WRITE"),
            "populate_write_works": populate_write_works(),
            "first_touch": {c: {b: {"gbps": total / r["s"] / 1e9, "s": r["s"], "faults": r["faults"]}
                                for b, r in by_block.items()}
                            for c, by_block in measured["first_touch"].items()},
            "wall_min": (time.monotonic() - started) / 60}
    results = {"meta": meta, "summary": summarize(runs, total), "runs": runs,
               "warmup": measured["warmup"], "diagnostics": measured["diagnostics"]}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    return render()


if __name__ == "__main__":
    sys.exit(main())
