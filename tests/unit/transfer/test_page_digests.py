"""Per-page KV digests for transfers by room (transfer/page_digests.py), on host rows laid out as
SGLang's KV buffers are (one [pages, page bytes] buffer per layer and K/V): what a prefill states,
what a decode's check says about the pages it received, and the `corrupt` fault it must catch.
The real transfer (two SGLang processes over NIXL) is tests/sglang's
test_every_injected_kv_fault_is_caught_by_the_page_digests."""

import logging

import numpy as np
import pytest

from pd_plugins.transfer import kv_digest
from pd_plugins.transfer.kv_faults import ALLOWED_VAR, KvFaults
from pd_plugins.transfer.page_digests import (
    KvDigestMismatch,
    PageChecks,
    corrupt,
    fault_target,
    page_digests,
)

PAGES, PAGE_BYTES = 16, 256


def engine_kv(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (PAGES, PAGE_BYTES), dtype=np.uint8) for _ in range(4)]


def moved(src: list[np.ndarray], src_pages, dest: list[np.ndarray], dest_pages) -> None:
    for s, d in zip(src, dest):
        d[dest_pages] = s[src_pages]


def test_a_page_digest_is_ws64_over_the_page_in_every_buffer_in_order():
    kv = engine_kv(1)
    stated = kv_digest.decode(page_digests(kv, [3, 9]), 2)
    assert stated.tolist() == [kv_digest.reference_digest(b"".join(b[p].tobytes() for b in kv))
                               for p in (3, 9)]
    assert page_digests([], [3]) is None  # device KV: no host rows, nothing stated


def test_received_pages_verify_against_the_slice_after_the_cached_prefix():
    prefill, decode = engine_kv(1), engine_kv(2)
    held = [4, 5, 6, 7]
    stated = page_digests(prefill, held)
    moved(prefill, held[1:], decode, [10, 11, 12])  # the decode had the first page cached
    checks = PageChecks()
    assert checks.check(decode, [10, 11, 12], stated, 1, len(held), 7, "p:1") == "verified"
    assert checks.counts == {"verified": 1, "mismatched": 0, "unverified": 0}


@pytest.mark.parametrize("page, byte", [(0, 0), (2, PAGE_BYTES - 1), (1, 100)])
def test_one_changed_byte_fails_the_room_naming_it_and_the_page(page, byte):
    prefill, decode = engine_kv(1), engine_kv(2)
    stated = page_digests(prefill, [4, 5, 6])
    moved(prefill, [4, 5, 6], decode, [0, 1, 2])
    decode[3][page, byte] ^= 1
    checks = PageChecks()
    with pytest.raises(KvDigestMismatch, match=f"room 42: KV digest mismatch at page {page} "
                                               r"\(1 of 3 pages"):
        checks.check(decode, [0, 1, 2], stated, 0, 3, 42, "p:1")
    assert checks.counts["mismatched"] == 1 and checks.counts["verified"] == 0


def test_pages_from_another_room_or_in_another_order_fail():
    prefill, decode = engine_kv(1), engine_kv(2)
    stated = page_digests(prefill, [4, 5])
    moved(prefill, [5, 4], decode, [0, 1])  # swapped pages: each whole, in the wrong place
    with pytest.raises(KvDigestMismatch, match="at page 0 \\(2 of 2"):
        PageChecks().check(decode, [0, 1], stated, 0, 2, 1, "p")
    with pytest.raises(KvDigestMismatch):  # untouched pages (a dropped WRITE): old KV
        PageChecks().check(decode, [8, 9], stated, 0, 2, 1, "p")


def test_no_stated_digests_is_unverified_counted_and_warned_once_per_peer(caplog):
    checks, kv = PageChecks(), engine_kv(1)
    with caplog.at_level(logging.DEBUG, "pd_plugins.transfer.page_digests"):
        for room in range(3):
            assert checks.check(kv, [0], None, 0, 1, room, "old-prefill:1") == "unverified"
        assert checks.check([], [0], "AAAAAAAAAAA=", 0, 1, 9, "gpu:1") == "unverified"
    assert checks.counts == {"verified": 0, "mismatched": 0, "unverified": 4}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["room 0: KV from old-prefill:1 used unverified (the prefill stated no "
                        "page digests)", "room 9: KV from gpu:1 used unverified (device KV)"]


def test_malformed_or_short_digest_lists_are_refused_not_verified():
    kv = engine_kv(1)
    stated = page_digests(kv, [0, 1])
    checks = PageChecks()
    with pytest.raises(ValueError, match="stated 2 page digests"):  # fewer than the pages read
        checks.check(kv, [0, 1], stated, 1, 2, 5, "p")
    with pytest.raises(ValueError, match="more than 1 digests"):  # beyond the room's page count
        checks.check(kv, [0], stated, 0, 1, 5, "p")
    with pytest.raises(ValueError, match="not base64"):
        checks.check(kv, [0], "!!!!", 0, 1, 5, "p")
    assert checks.counts == {"verified": 0, "mismatched": 0, "unverified": 0}


def test_corrupt_hits_only_matching_rooms_counts_each_and_is_always_caught():
    faults = KvFaults.from_spec("corrupt:match=room:71", "t", {ALLOWED_VAR: "1"})
    prefill = engine_kv(1)
    stated = page_digests(prefill, [0, 1, 2])
    caught = 0
    for room in [*range(71000, 71050), *range(10000, 10010)]:
        decode = engine_kv(2)
        moved(prefill, [0, 1, 2], decode, [5, 6, 7])
        hit = corrupt(faults, decode, np.array([5, 6, 7]), room)
        assert hit == fault_target(room).startswith("room:71")
        try:
            PageChecks().check(decode, [5, 6, 7], stated, 0, 3, room, "p")
        except KvDigestMismatch:
            caught += 1
    assert caught == faults.injected["corrupt"] == 50


def test_no_faults_configured_touches_nothing():
    kv = engine_kv(1)
    before = [b.copy() for b in kv]
    assert not corrupt(KvFaults.none(), kv, [0, 1], 71000)
    assert all((a == b).all() for a, b in zip(kv, before))


def test_a_room_with_no_pages_to_move_states_and_verifies_an_empty_list():
    kv = engine_kv(1)
    stated = page_digests(kv, [])
    assert stated == ""
    assert PageChecks().check(kv, [], stated, 0, 0, 3, "p") == "verified"
