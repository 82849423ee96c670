"""Loader for Mooncake (FAST'25) JSONL traces: the one public trace with real prefix sharing.

Each line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}` where
`hash_ids` are chained 512-token prefix-block ids (remapped to small ints upstream; kept as is).
Every line is validated, since a silently wrong hash list would fake or hide cache hits.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pd_plugins.workloads.trace import TraceFormatError, TraceRequest, blocks_for

_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_line(path: str | os.PathLike, lineno: int, line: str) -> tuple[float, int, int, tuple]:
    """(timestamp_ms, input, output, hash_ids) of one line, or TraceFormatError saying why not."""
    def bad(what: str) -> TraceFormatError:
        return TraceFormatError(path, lineno, what)

    try:
        rec = json.loads(line)
    except ValueError as e:
        raise bad(f"not valid JSON ({e})") from None
    if not isinstance(rec, dict):
        raise bad(f"expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in _KEYS if k not in rec]
    if missing:
        raise bad(f"missing key(s) {', '.join(missing)}")
    ts = rec["timestamp"]
    if not (_is_int(ts) or isinstance(ts, float)) or not 0 <= ts < float("inf"):
        raise bad(f"timestamp must be a non-negative number of ms, got {ts!r}")
    for key in ("input_length", "output_length"):
        if not _is_int(rec[key]) or rec[key] < 0:
            raise bad(f"{key} must be a non-negative int, got {rec[key]!r}")
    hashes = rec["hash_ids"]
    if not isinstance(hashes, list) or not all(_is_int(h) for h in hashes):
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
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                rows.append(_parse_line(path, lineno, line))
    rows.sort(key=lambda row: row[0])  # stable: equal timestamps keep file order
    t0 = rows[0][0] if rows else 0
    return [TraceRequest(request_id=i, arrival_s=(ts - t0) / 1000, input_tokens=n_in,
                         output_tokens=max(1, n_out), block_hashes=hashes)
            for i, (ts, n_in, n_out, hashes) in enumerate(rows)]
