"""Loader for pd-router's traffic record (routers/traffic_record.py): the router's own traffic as
a workload, read like the public traces by the simulator, the replay and pd-planner.

One JSON object per line: `t` (arrival, unix s), `model`, `input_tokens`, `output_tokens`,
`block_keys` (chained keys of the prompt's full blocks, at most the router's max_block_keys),
`block_size`, `session`, `turn`, `decision`, `prefill`, `decode`, `ttft_s`, `tpot_s`, `e2e_s`,
`status`. Records are written as requests end, so they are sorted here by arrival.

Block ids: a TraceRequest needs ceil(input_tokens / block_size) of them. The record's keys cover
the full blocks up to max_block_keys; the rest (blocks past that cap, and the partial last block)
get ids of their own, unique to the request: what is not known to be shared counts as not shared.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pd_plugins.workloads.trace import JsonLine, TraceRequest, blocks_for, is_int, utf8_line

_MASK64 = (1 << 64) - 1
_KEYS = ("t", "model", "input_tokens", "output_tokens", "block_keys", "block_size")
DECISIONS = ("disaggregated", "local", "rejected", "failed")


def _own_block_id(request_no: int, block_no: int) -> int:
    """An id no other request's block has (splitmix64 of the pair; records' keys are 64-bit hashes
    too, so a clash is as unlikely as one between two keys)."""
    x = ((request_no << 24) ^ block_no ^ 0x7E57_C0DE_0000_0000) & _MASK64
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _parse(path: str | os.PathLike, lineno: int, line: str) -> dict[str, Any]:
    row = JsonLine(path, lineno, line, _KEYS)
    rec, bad = row.rec, row.bad
    row.time("t", "seconds")
    row.count("input_tokens"), row.count("output_tokens")
    if not is_int(rec["block_size"]) or rec["block_size"] <= 0:
        raise bad(f"block_size must be a positive int, got {rec['block_size']!r}")
    keys = rec["block_keys"]
    if not isinstance(keys, list) or not all(is_int(k) for k in keys):
        raise bad("block_keys must be a list of ints")
    if len(keys) > rec["input_tokens"] // rec["block_size"]:
        raise bad(f"{len(keys)} block_keys for {rec['input_tokens']} tokens in blocks of "
                  f"{rec['block_size']}: more than its full blocks")
    if not isinstance(rec["model"], str):
        raise bad("model must be a string")
    session, turn = rec.get("session"), rec.get("turn")
    if session is not None and not isinstance(session, str):
        raise bad("session must be a string or null")
    if turn is not None and (not is_int(turn) or turn < 0):
        raise bad("turn must be a non-negative int or null")
    if rec.get("decision", "disaggregated") not in DECISIONS:
        raise bad(f"decision must be one of {', '.join(DECISIONS)}, got {rec.get('decision')!r}")
    return rec


def rotated_paths(path: str | os.PathLike) -> list[str]:
    """`path` and its rotated files, oldest first (path.N .. path.1, path)."""
    path = os.fspath(path)
    older, n = [], 1
    while os.path.exists(f"{path}.{n}"):
        older.append(f"{path}.{n}")
        n += 1
    return [*reversed(older), path]


def load_traffic_record(path: str | os.PathLike | Sequence[str | os.PathLike],
                        model: str | None = None, *, with_rotated: bool = False,
                        include_unserved: bool = True, origin: float | None = None
                        ) -> list[TraceRequest]:
    """The requests of a traffic record (one file, several, or with `with_rotated` the file and
    its rotated backups), sorted by arrival, arrivals in seconds from `origin` (unix s; default
    the first arrival; 0 keeps the record's clock), ids 0.. in that order, `block_tokens` the
    record's block size. `model`: keep that model's records (required when the record holds
    several). `include_unserved`: keep rejected and failed requests too (they were demand all
    the same). Bad lines raise TraceFormatError naming file and line."""
    return requests_of_records(read_records(path, model, with_rotated=with_rotated,
                                            include_unserved=include_unserved), origin)


def read_records(path: str | os.PathLike | Sequence[str | os.PathLike],
                 model: str | None = None, *, with_rotated: bool = False,
                 include_unserved: bool = True) -> list[dict[str, Any]]:
    """The checked lines of a traffic record, as dicts in file order (`load_traffic_record`'s
    arguments)."""
    if isinstance(path, (str, os.PathLike)):
        paths = rotated_paths(path) if with_rotated else [os.fspath(path)]
    else:
        paths = [os.fspath(p) for p in path]
    rows: list[dict[str, Any]] = []
    for file in paths:
        with open(file, encoding="utf-8", errors="surrogateescape") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    rows.append(_parse(file, lineno, utf8_line(file, lineno, line)))
    models = {r["model"] for r in rows}
    if model is None and len(models) > 1:
        raise ValueError(f"the record holds several models ({', '.join(sorted(models))}): name one")
    if model is not None:
        rows = [r for r in rows if r["model"] == model]
    if not include_unserved:
        rows = [r for r in rows if r.get("decision") in ("disaggregated", "local")]
    return rows


def requests_of_records(rows: list[dict[str, Any]], origin: float | None = None
                        ) -> list[TraceRequest]:
    """Records (dicts with at least `t`, `input_tokens`, `output_tokens`, `block_keys`,
    `block_size`) as TraceRequests, as `load_traffic_record` returns them; also what pd-planner
    makes of the router's requests in flight (GET /admin/in_flight), listed in the same form."""
    sizes = {r["block_size"] for r in rows}
    if len(sizes) > 1:
        raise ValueError(f"records hashed at several block sizes ({sorted(sizes)}): load them apart")
    rows = sorted(rows, key=lambda r: r["t"])  # written as requests end; stable for equal arrivals
    t0 = origin if origin is not None else rows[0]["t"] if rows else 0.0
    out = []
    for i, r in enumerate(rows):
        size, n_in = r["block_size"], r["input_tokens"]
        keys = list(r["block_keys"])
        hashes = keys + [_own_block_id(i, k) for k in range(len(keys), blocks_for(n_in, size))]
        out.append(TraceRequest(request_id=i, arrival_s=r["t"] - t0, input_tokens=n_in,
                                output_tokens=max(1, r["output_tokens"]), block_hashes=tuple(hashes),
                                session_id=r.get("session"), turn=r.get("turn") or 0,
                                block_tokens=size))
    return out
