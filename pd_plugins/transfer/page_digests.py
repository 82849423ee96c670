"""Per-page KV digests for transfers by room (SGLang pd-nixl): the producer states one ws64
digest per page (transfer/kv_digest.py, all of the page's KV buffers in order), the consumer
checks the pages it received against them before it uses the KV (issue 28;
docs/plans/kv-verification.md §4.5).

Host KV only: `kv_rows` are the engine's KV buffers as [num_pages, page bytes] row views. On
device KV there are no host rows and a room is `unverified` (on CUDA, SGLang's own
`--disaggregation-enable-kv-checksum` rides in the metadata row these backends carry).

Outcomes per room: `verified`; `unverified` (the producer stated no digests: an older prefill, or
device KV; counted and logged, the KV is used); a mismatch raises `KvDigestMismatch` (the room
fails, the KV is never used). The `corrupt` fault (transfer/kv_faults.py) damages one landed
page just before the check, so a test proves the check catches what it injects.

Engine-agnostic: numpy and transfer/ only.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np

from pd_plugins.transfer import kv_digest
from pd_plugins.transfer.kv_faults import KvFaults, position

logger = logging.getLogger(__name__)

VERDICTS = ("verified", "mismatched", "unverified")
MAX_WARNED_PEERS = 1_000  # peers whose unverified rooms were logged as a warning already


class KvDigestMismatch(RuntimeError):
    """A received page's digest differs from the one its producer stated."""


def fault_target(room: int) -> str:
    """What a PD_KV_FAULTS `match` is tested against for a room (`match=room:12` hits rooms
    whose number starts with 12)."""
    return f"room:{room}"


def page_digests(kv_rows: Sequence[np.ndarray], pages: Sequence[int]) -> str | None:
    """The encoded digests of `pages` (None without host rows: device KV is not digested here)."""
    if not kv_rows:
        return None
    return kv_digest.encode(kv_digest.block_digests(kv_rows, pages))


def corrupt(faults: KvFaults, kv_rows: Sequence[np.ndarray], pages: Sequence[int],
            room: int) -> bool:
    """The `corrupt` fault, if it targets this room: XOR one byte of one landed page (which page,
    buffer and byte are fixed by the rule's seed and the room). Whether it was injected."""
    if not faults.enabled or not kv_rows or not len(pages):
        return False
    target = fault_target(room)
    rule = faults.take("corrupt", target)
    if rule is None:
        return False
    page = int(pages[position(rule, target + ":page", len(pages))])
    rows = kv_rows[position(rule, target + ":buffer", len(kv_rows))]
    rows[page, position(rule, target, rows.shape[1])] ^= 0x5A
    return True


class PageChecks:
    """A receiving engine's checks: verdict counts (per room) and the check itself. Thread-safe."""

    def __init__(self) -> None:
        self.counts = {verdict: 0 for verdict in VERDICTS}
        self._lock = threading.Lock()
        self._warned: OrderedDict[str, None] = OrderedDict()

    def check(self, kv_rows: Sequence[np.ndarray], pages: Sequence[int], stated: object,
              first_page: int, max_pages: int, room: int, peer: str) -> str:
        """Check received `pages` (they hold the producer's pages `first_page...`) against the
        producer's `stated` digests (the encoded text; None: it stated none; at most `max_pages`
        of them are read). Returns the verdict; raises KvDigestMismatch naming the room and the
        first bad page (in the producer's numbering), ValueError for a malformed list."""
        if stated is None or not kv_rows:
            self.count("unverified")
            why = "the prefill stated no page digests" if stated is None else "device KV"
            self.warn_once(peer, f"room {room}: KV from {peer} used unverified ({why})")
            return "unverified"
        expected = kv_digest.decode(stated, max_pages)
        want = expected[first_page:first_page + len(pages)]
        if len(want) != len(pages):
            raise ValueError(f"room {room}: the prefill stated {len(expected)} page digests; "
                             f"this decode received pages {first_page}..{first_page + len(pages)}")
        got = kv_digest.block_digests(kv_rows, pages)
        bad = np.flatnonzero(got != want)
        if bad.size:
            self.count("mismatched")
            raise KvDigestMismatch(
                f"room {room}: KV digest mismatch at page {first_page + int(bad[0])} "
                f"({bad.size} of {len(pages)} pages differ from what the prefill at {peer} "
                "stated); the KV is not used")
        self.count("verified")
        return "verified"

    def count(self, verdict: str) -> None:
        with self._lock:
            self.counts[verdict] += 1

    def warn_once(self, peer: str, message: str) -> None:
        with self._lock:
            first = peer not in self._warned
            if first:
                self._warned[peer] = None
                while len(self._warned) > MAX_WARNED_PEERS:
                    self._warned.popitem(last=False)
        (logger.warning if first else logger.debug)("%s", message)
