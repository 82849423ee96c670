"""Loader for the Azure LLM inference trace 2023 (Splitwise): arrivals and lengths, no prefixes.

CSV with header `TIMESTAMP,ContextTokens,GeneratedTokens`; TIMESTAMP is wall-clock time with 7
fractional digits (`2023-11-16 18:15:46.6805900`), one more than strptime's %f accepts, so the
fraction is parsed by hand into integer nanoseconds (arrivals stay exact to the tick).
"""

from __future__ import annotations

import os
import re
from datetime import datetime

from pd_plugins.workloads.trace import (MAX_TRACE_TOKENS, TraceFormatError, TraceRequest,
                                        blocks_for, utf8_line)

HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
AZURE_ID_BASE = 1 << 40
"""First block id handed out: far above Mooncake's remapped ids (< 2**20) and below the
conversation generator's (>= 2**63), so workloads can be mixed without false sharing."""

_TIMESTAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:\.(\d{1,9}))?")
_EPOCH = datetime(1970, 1, 1)


def _timestamp_ns(text: str) -> int:
    """Nanoseconds since 1970 of a naive wall-clock stamp; ValueError if malformed."""
    m = _TIMESTAMP.fullmatch(text)
    if not m:
        raise ValueError("expected YYYY-MM-DD HH:MM:SS[.fraction of up to 9 digits]")
    whole = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S") - _EPOCH
    frac = int((m[2] or "").ljust(9, "0"))
    return (whole.days * 86400 + whole.seconds) * 10**9 + frac


def _parse_row(path: str | os.PathLike, lineno: int, line: str) -> tuple[int, int, int]:
    """(timestamp_ns, context, generated) of one data row, or TraceFormatError saying why not."""
    cols = [c.strip() for c in line.split(",")]
    if len(cols) != len(HEADER):
        raise TraceFormatError(path, lineno, f"expected {len(HEADER)} columns, got {len(cols)}")
    try:
        ts = _timestamp_ns(cols[0])
    except ValueError as e:
        raise TraceFormatError(path, lineno, f"bad TIMESTAMP {cols[0]!r}: {e}") from None
    counts = []
    for name, text in zip(HEADER[1:], cols[1:]):
        if not (text.isascii() and text.isdigit()):
            raise TraceFormatError(path, lineno, f"{name} must be a non-negative int, got {text!r}")
        if len(text.lstrip("0")) > len(str(MAX_TRACE_TOKENS)) or int(text) > MAX_TRACE_TOKENS:
            shown = text if len(text) <= 20 else text[:20] + "..."
            raise TraceFormatError(path, lineno, f"{name} {shown} is over {MAX_TRACE_TOKENS} "
                                                 "tokens (a corrupt line?)")
        counts.append(int(text))
    return ts, counts[0], counts[1]


def load_azure(path: str | os.PathLike, id_offset: int = AZURE_ID_BASE) -> list[TraceRequest]:
    """All rows as requests, stably sorted by time, arrivals in seconds from the earliest row.

    Azure has no prefix information, so every request gets fresh block ids counting up from
    `id_offset`: no two requests share a block. Bad rows raise TraceFormatError with the line.
    """
    rows: list[tuple[int, int, int]] = []
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        header = tuple(c.strip() for c in utf8_line(path, 1, f.readline()).split(","))
        if header != HEADER:
            raise TraceFormatError(path, 1, f"header must be {','.join(HEADER)}, "
                                            f"got {','.join(header)}")
        for lineno, line in enumerate(f, 2):
            if line.strip():
                rows.append(_parse_row(path, lineno, utf8_line(path, lineno, line)))
    rows.sort(key=lambda row: row[0])
    t0 = rows[0][0] if rows else 0
    requests, next_id = [], id_offset
    for i, (ts, n_in, n_out) in enumerate(rows):
        n_blocks = blocks_for(n_in)
        requests.append(TraceRequest(request_id=i, arrival_s=(ts - t0) / 1e9, input_tokens=n_in,
                                     output_tokens=max(1, n_out),
                                     block_hashes=tuple(range(next_id, next_id + n_blocks))))
        next_id += n_blocks
    return requests
