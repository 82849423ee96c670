"""Loader for Mooncake (FAST'25) JSONL traces: the one public trace with real prefix sharing.

Each line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}` where
`hash_ids` are chained 512-token prefix-block ids (remapped to small ints upstream; kept as is).
Every line is validated, since a silently wrong hash list would fake or hide cache hits.
"""

from __future__ import annotations

import os

from pd_plugins.workloads.trace import JsonLine, TraceRequest, blocks_for, is_int, utf8_line

_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


def _parse_line(path: str | os.PathLike, lineno: int, line: str) -> tuple[float, int, int, tuple]:
    """(timestamp_ms, input, output, hash_ids) of one line, or TraceFormatError saying why not."""
    row = JsonLine(path, lineno, line, _KEYS)
    rec, bad = row.rec, row.bad
    ts = row.time("timestamp", "ms")
    row.count("input_length"), row.count("output_length")
    hashes = rec["hash_ids"]
    if not isinstance(hashes, list) or not all(is_int(h) for h in hashes):
        raise bad("hash_ids must be a list of ints")
    want = blocks_for(rec["input_length"])
    if len(hashes) != want:
        raise bad(f"hash_ids has {len(hashes)} ids, expected ceil(input_length/512) = {want}")
    return ts, rec["input_length"], rec["output_length"], tuple(hashes)


def load_mooncake(path: str | os.PathLike) -> list[TraceRequest]:
    """All requests of a Mooncake trace, stably sorted by timestamp, arrivals in seconds from the
    earliest one, ids 0.. in that order. Empty lines are skipped; any bad line raises
    TraceFormatError naming the file and line."""
    rows = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                rows.append(_parse_line(path, lineno, utf8_line(path, lineno, line)))
    rows.sort(key=lambda row: row[0])  # stable: equal timestamps keep file order
    t0 = rows[0][0] if rows else 0
    return [TraceRequest(request_id=i, arrival_s=(ts - t0) / 1000, input_tokens=n_in,
                         output_tokens=max(1, n_out), block_hashes=hashes)
            for i, (ts, n_in, n_out, hashes) in enumerate(rows)]
