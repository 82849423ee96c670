"""Page lists as runs, the compact form registry records carry them in.

A list of page ids becomes a flat JSON list [start, length, start, length, ...] of its runs of
consecutive ids: a contiguous room of any size is two numbers, and the worst case (no two pages
adjacent) costs about one id plus ",1," per page: 131,072 such pages (a 128k-token prompt at page
size 1) with ids below 10^9 take at most 1.6 MB, within the registry's 2 MiB record cap.
"""

from __future__ import annotations

import numpy as np


def encode_pages(pages) -> list[int]:
    pages = np.asarray(pages, dtype=np.int64).ravel()
    if pages.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [pages.size])))
    return np.column_stack((pages[starts], lengths)).ravel().tolist()


def decode_pages(runs, max_pages: int) -> np.ndarray:
    """The page ids of `runs`; ValueError for anything but non-negative int pairs (lengths >= 1)
    or more than `max_pages` pages (a peer cannot make this allocate more)."""
    if not isinstance(runs, list) or len(runs) % 2 or not all(
            type(v) is int for v in runs):  # noqa: E721 - bools are not page ids
        raise ValueError("page runs are a flat list of integer [start, length] pairs")
    try:
        pairs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    except OverflowError:
        raise ValueError("page runs hold a number beyond 64 bits") from None
    starts, lengths = pairs[:, 0], pairs[:, 1]
    if ((starts < 0) | (starts > 2**62) | (lengths < 1) | (lengths > max_pages)).any():
        raise ValueError("page runs need 0 <= start <= 2^62 and 1 <= length <= max_pages")
    total = int(lengths.sum())
    if total > max_pages:
        raise ValueError(f"page runs name {total} pages, more than the {max_pages} expected")
    if not pairs.size:
        return np.zeros(0, dtype=np.int64)
    # each page is its run's start plus its offset in the run
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + offsets
