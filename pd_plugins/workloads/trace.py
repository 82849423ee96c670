"""The request record every workload source produces, and the transforms benchmarks apply to it.

A trace request carries only what a router can act on: when it arrives, how long its prompt and
answer are, and which prefix blocks its prompt shares with other requests (`block_hashes`).
`prompt_token_ids` turns those hashes into concrete token ids, so the same workload can drive a
real engine whose prefix cache then sees exactly the sharing the trace describes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

HASH_BLOCK_SIZE = 512
"""Tokens per prefix block behind `block_hashes` by default (Mooncake's block size, used for the
traces; generated conversations may use a finer one, as an engine's prefix cache does)."""

_MASK64 = (1 << 64) - 1
MAX_TRACE_TOKENS = 1 << 24
"""Most tokens a trace line may give a prompt or an answer (16M, past any model's context): a
larger count is a corrupt line, and loading it would allocate its blocks (or simulate its steps)."""


@dataclass(slots=True)
class TraceRequest:
    """One request of a workload.

    `block_hashes[k]` stands for tokens [k*B, (k+1)*B) *and everything before them* (chained),
    where B is `block_tokens` (512 unless the source says otherwise), so two requests share their
    first k ids iff they share a k*B-token prefix. There are ceil(input_tokens / B) ids; the last
    one may cover a partial block.
    """

    request_id: int  # 0.. in arrival order
    arrival_s: float  # seconds from the start of the workload
    input_tokens: int
    output_tokens: int  # >= 1 (a trace's 0 becomes 1: engines always emit a token)
    block_hashes: tuple[int, ...]
    session_id: str | None = None
    turn: int = 0  # 0-based turn within its session
    block_tokens: int = HASH_BLOCK_SIZE  # tokens per block behind block_hashes

    def full_block_hashes(self) -> tuple[int, ...]:
        """Ids of the FULL blocks only: what a block-granular prefix cache can hold and reuse."""
        return self.block_hashes[: self.input_tokens // self.block_tokens]


class TraceFormatError(ValueError):
    """A malformed trace line; the message reads `<file>:<1-based line>: <what is wrong>`."""

    def __init__(self, path: object, line: int, what: str) -> None:
        super().__init__(f"{path}:{line}: {what}")
        self.path, self.line, self.what = str(path), line, what


def utf8_line(path: object, lineno: int, line: str) -> str:
    """A line of a file opened with errors="surrogateescape" (as the loaders open traces): bytes
    that were not UTF-8 are a TraceFormatError naming the line, not a UnicodeDecodeError from
    wherever in the file the decoder's buffer reached them."""
    if not line.isascii():
        try:
            line.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TraceFormatError(path, lineno, f"not UTF-8 text (a bad byte at column "
                                                 f"{e.start + 1})") from None
    return line


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class JsonLine:
    """One line of a JSON-lines trace, checked field by field; every problem is a
    TraceFormatError naming the file and line (Mooncake traces, pd-router's traffic record)."""

    def __init__(self, path: object, lineno: int, line: str, keys: Sequence[str]) -> None:
        self.path, self.lineno = path, lineno
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise self.bad(f"not valid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise self.bad(f"expected a JSON object, got {type(rec).__name__}")
        missing = [k for k in keys if k not in rec]
        if missing:
            raise self.bad(f"missing key(s) {', '.join(missing)}")
        self.rec: dict[str, Any] = rec

    def bad(self, what: str) -> TraceFormatError:
        return TraceFormatError(self.path, self.lineno, what)

    def time(self, key: str, unit: str) -> float:
        value = self.rec[key]
        if not (is_int(value) or isinstance(value, float)) or not 0 <= value < float("inf"):
            raise self.bad(f"{key} must be a non-negative number of {unit}, got {value!r}")
        return value

    def count(self, key: str) -> int:
        value = self.rec[key]
        if not is_int(value) or value < 0:
            raise self.bad(f"{key} must be a non-negative int, got {value!r}")
        if value > MAX_TRACE_TOKENS:
            raise self.bad(f"{key} {value} is over {MAX_TRACE_TOKENS} tokens (a corrupt line?)")
        return value


def blocks_for(tokens: int, block_tokens: int = HASH_BLOCK_SIZE) -> int:
    """Number of prefix blocks (the last one possibly partial) that cover `tokens` tokens."""
    return -(-tokens // block_tokens)


# --- prompt materialisation -------------------------------------------------------------------

_TABLE_BITS = 16


@functools.cache
def _token_table() -> tuple[int, ...]:
    """Fixed pseudo-random 31-bit values; a block reads them along a stride chosen by its id."""
    rng = random.Random(0x5EED_B10C)
    return tuple(rng.getrandbits(31) for _ in range(1 << _TABLE_BITS))


def _mix64(x: int) -> int:
    """splitmix64 finaliser: spreads any id (small Mooncake ints included) over 64 bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _block_tokens(block_hash: int, n: int, vocab_size: int) -> list[int]:
    """The first `n` tokens of the block with this id: a function of the id alone.

    64 bits of the mixed id pick a start, an odd stride (so 512 reads hit 512 distinct table
    entries) and an XOR salt; distinct ids give distinct blocks with overwhelming probability.
    """
    m = _mix64(block_hash & _MASK64)
    size_mask = (1 << _TABLE_BITS) - 1
    start, stride, salt = m & size_mask, (m >> 16) & size_mask | 1, m >> 33
    table = _token_table()
    return [(table[(start + i * stride) & size_mask] ^ salt) % vocab_size for i in range(n)]


def prompt_token_ids(req: TraceRequest, vocab_size: int = 32000) -> list[int]:
    """A prompt of `req.input_tokens` ids in [0, vocab_size) consistent with `req.block_hashes`.

    Block k's tokens depend only on block_hashes[k], so equal hash prefixes give equal token
    prefixes and a different id gives a different block. Costs about 1 ms per 10k tokens.
    """
    ids: list[int] = []
    for k, h in enumerate(req.block_hashes):
        n = min(req.block_tokens, req.input_tokens - k * req.block_tokens)
        ids += _block_tokens(h, n, vocab_size)
    return ids


# --- transforms -------------------------------------------------------------------------------


def scale_time(requests: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Arrivals divided by `factor` (2 = twice the request rate); returns new objects."""
    if not factor > 0:
        raise ValueError(f"scale factor must be > 0, got {factor}")
    return [dataclasses.replace(r, arrival_s=r.arrival_s / factor) for r in requests]


def spread_bursts(requests: Sequence[TraceRequest], window_s: float) -> list[TraceRequest]:
    """Spread requests that share a timestamp evenly over [t, t + window_s), in trace order.

    The Mooncake trace records arrivals in batches every 3 s (timestamps quantised), so a dozen
    requests "arrive" at once and their order is arbitrary: any FCFS queue then depends on which of
    them a replay happens to deliver first. Spreading them over the quantum makes the order well
    defined (and closer to how they really came)."""
    if not window_s > 0:
        raise ValueError(f"window must be > 0, got {window_s}")
    groups: dict[float, list[TraceRequest]] = {}
    for r in requests:
        groups.setdefault(r.arrival_s, []).append(r)
    out = []
    for t, group in groups.items():
        step = window_s / len(group)
        out += [dataclasses.replace(r, arrival_s=t + i * step) for i, r in enumerate(group)]
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out


def slice_window(requests: Sequence[TraceRequest], start_s: float, duration_s: float
                 ) -> list[TraceRequest]:
    """Requests arriving in [start_s, start_s + duration_s), times re-based so the window starts at
    0 and ids renumbered 0.. (a leading idle gap inside the window is kept)."""
    end = start_s + duration_s
    picked = [r for r in requests if start_s <= r.arrival_s < end]
    return [dataclasses.replace(r, request_id=i, arrival_s=r.arrival_s - start_s)
            for i, r in enumerate(picked)]


def first_n(requests: Sequence[TraceRequest], n: int) -> list[TraceRequest]:
    """The first `n` requests (a quick, smaller replay of the same workload)."""
    return list(requests[:n])


def _percentile(sorted_values: list[int], p: float) -> float:
    """Nearest-rank percentile of an already sorted, non-empty list."""
    return float(sorted_values[max(0, math.ceil(p / 100 * len(sorted_values)) - 1)])


def _repeat_share(blocks_per_request: Iterable[Iterable[int]]) -> float:
    """Share of block references whose id already appeared in an earlier reference."""
    seen: set[int] = set()
    total = repeats = 0
    for blocks in blocks_per_request:
        for h in blocks:
            total += 1
            repeats += h in seen
            seen.add(h)
    return repeats / total if total else 0.0


def summary(requests: Sequence[TraceRequest]) -> dict[str, float]:
    """Headline numbers of a workload (requests taken in list order, i.e. arrival order).

    `cacheable_share` counts every block reference, the partial last block included, that repeats
    an earlier id: this is the definition that reproduces the traces README's 36.6% for the Mooncake
    conversation trace. `full_block_cacheable_share` counts full blocks only (38.2% there), which
    is closer to what a block-granular prefix cache can actually reuse.
    """
    if not requests:
        return {"count": 0, "span_s": 0.0, "rate_per_s": 0.0, "sessions": 0}
    arrivals = [r.arrival_s for r in requests]
    span = max(arrivals) - min(arrivals)
    out: dict[str, float] = {"count": len(requests), "span_s": span,
                             "rate_per_s": len(requests) / span if span > 0 else 0.0}
    for name, values in (("input", sorted(r.input_tokens for r in requests)),
                         ("output", sorted(r.output_tokens for r in requests))):
        out[f"{name}_mean"] = sum(values) / len(values)
        out[f"{name}_p50"] = _percentile(values, 50)
        out[f"{name}_p99"] = _percentile(values, 99)
    out["cacheable_share"] = _repeat_share(r.block_hashes for r in requests)
    out["full_block_cacheable_share"] = _repeat_share(r.full_block_hashes() for r in requests)
    out["sessions"] = len({r.session_id for r in requests if r.session_id is not None})
    return out
