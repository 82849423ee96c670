"""Page lists as runs (transfer/page_runs.py): round trips, size, and what a peer cannot send."""

import json

import numpy as np
import pytest

from pd_plugins.transfer.page_runs import decode_pages, encode_pages


@pytest.mark.parametrize("pages", [[], [7], [3, 4, 5, 9, 10, 11], [5, 4, 3], [1, 1, 2],
                                   list(range(1000)), list(range(0, 2000, 2))])
def test_round_trip(pages):
    runs = encode_pages(pages)
    assert decode_pages(runs, max_pages=max(len(pages), 1)).tolist() == pages


def test_runs_are_compact():
    assert encode_pages(range(131_072)) == [0, 131_072]
    assert encode_pages([3, 4, 5, 9, 10, 11]) == [3, 3, 9, 3]
    worst = encode_pages(np.arange(131_072) * 2 + 10**8)  # no two pages adjacent, 9-digit ids
    assert len(json.dumps(worst, separators=(",", ":"))) < 1.6e6  # as the registry client sends


@pytest.mark.parametrize("runs", [
    [1], [1, 2, 3], "0,1", [[0, 1]], [0, 0], [-1, 2], [0, -2], [True, 1], [0.5, 1],
    [0, 11],            # more pages than the limit
    [0, 6, 100, 6],     # together more than the limit
    [2**64, 1],         # beyond 64 bits
    [0, 2**62] * 4,     # a sum that would overflow
])
def test_a_peer_cannot_send_junk_or_make_it_allocate(runs):
    with pytest.raises(ValueError):
        decode_pages(runs, max_pages=10)
