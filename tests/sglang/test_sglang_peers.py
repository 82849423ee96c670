"""What a peer can make pd-plugins' SGLang backends do (tests/sglang/peer_roles.py): a request's
bootstrap address that is not a working registry, NIXL agents other than the room's peer, holders
of the peer secret. Real SGLang classes, a real registry, real NIXL (UCX on loopback); each role
is its own process, forked from one interpreter with SGLang imported (role_forkserver.py)."""

from __future__ import annotations

import os

import pytest

from pd_plugins.testing.sglang_env import SGLANG_PYTHON
from pd_plugins.transfer.shm_pool import remove_pool

pytestmark = pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                reason="no .venv-sglang: run `make bootstrap` (scripts/bootstrap.sh)")

KV_POLL_FAILED, KV_POLL_TRANSFERRING, KV_POLL_SUCCESS = 0, 3, 4


@pytest.fixture
def peer_role(forkserver, tmp_path):
    """Start peer_roles.py's role `name` (with `env` over a test pool and UCX on loopback)."""
    path = f"/dev/shm/pd-test-sglang-peers-{os.getpid()}-{tmp_path.name}"
    started = []

    def start(name: str, env: dict | None = None, spec: dict | None = None):
        full = {**os.environ, "PD_SHM_POOL": path, "PD_SHM_POOL_GB": "0.01",
                "SGLANG_PLUGINS": "pd_plugins", "PYTHONWARNINGS": "ignore",
                "UCX_NET_DEVICES": "lo", **(env or {})}
        started.append(forkserver.start(full, "peer", {"role": name, **(spec or {})}))
        return started[-1]

    yield start
    for role in started:
        role.stop()
    remove_pool(path)


def test_a_bootstrap_address_that_stalls_holds_the_scheduler_briefly_and_fails_the_room(peer_role):
    """A request's bootstrap address (SGLang's protocol: the request names it) that accepts and
    trickles its answer a byte every 0.2 s: each registry call from the scheduler's thread ends
    within REGISTRY_CALL_S (1 s; urllib's per-read timeout had kept one blocked for good), the
    receiver asks nothing for a heartbeat interval after a stall, and two stalls in a row fail the
    room: in the bootstrap (both backends; also when connections that fail at once come between
    the stalls: only a signed answer ends a run of stalls) and while a pd-nixl pull decode waits
    for its room."""
    role = peer_role("stalled_registry", {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1",
                                          "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "120",
                                          "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120"})
    for case in ("pd-shm bootstrap", "pd-nixl bootstrap",
                 "pd-shm bootstrap, stalls between failures", "pd-nixl pull transfer"):
        got = role.next_event(timeout_s=90)
        assert got.get("case") == case, got  # {"event": "stuck"}: a poll held the thread 30 s
        assert got["state"] == KV_POLL_FAILED, got
        assert "stalled 2 calls in a row" in got["failure"], got
        assert got["init_s"] < 1.6 and got["longest_poll_s"] < 1.6, got
        # two stalled calls of 1 s, a heartbeat interval apart; the rest is quick
        assert got["init_s"] + got["blocked_s"] < 3.5, got
        assert got["took_s"] < 10, got


def test_a_first_contact_address_that_stalls_holds_the_scheduler_briefly(peer_role):
    """SGLang's first contact with a request's address (DecodePreallocQueue._resolve_pending_reqs
    calls try_ensure_parallel_info 15 times, a retry interval apart, then aborts the room) keeps
    the receiver's rules per address: nothing asked for a heartbeat interval after a stalled
    call, nothing more after two stalls in a row (15 stalled calls of 1 s each before). The
    manager keeps failure reasons for at most PARALLEL_INFO_ADDRESSES addresses."""
    role = peer_role("stalled_first_contact", {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1"},
                     {"retry_s": 0.2, "addresses": 4200})
    got = role.next_event(timeout_s=120)
    assert got.get("event") == "first_contact", got  # {"event": "stuck"}: held 60 s
    assert got["pending"] == 0 and "stalled 2 calls in a row" in got["failure"], got
    assert got["longest_s"] < 1.6 and got["blocked_s"] < 3.5, got  # two stalled calls of 1 s
    assert got["errors_kept"] == 4096, got


def test_an_aborted_push_decode_withdraws_its_target_even_after_a_stall(peer_role):
    """A pd-nixl push decode aborted within a heartbeat interval of a stalled registry call
    (possibly its target's publication, landed with its answer lost) still withdraws the target:
    it had asked nothing, so a prefill could claim it and WRITE into pages SGLang freed."""
    got = peer_role("abort_while_quiet", {"PD_NIXL_MODE": "push"}).next_event(timeout_s=60)
    assert got.get("event") == "aborted", got
    assert got["state"] == KV_POLL_FAILED and got["target"] == "withdrawn", got


def test_a_push_decode_keeps_its_pages_while_the_registry_cannot_say_nobody_writes(peer_role):
    """Past its waiting timeout a pd-nixl push decode withdraws its target. Only "withdrawn"
    (200) means no WRITE can land: it fails at once and SGLang frees its pages. A target the
    registry no longer knows (404: evicted) or no answer (the registry is gone) may have been
    claimed: the decode keeps its pages MAX_WRITE_S (3 s here) before it fails (it had taken
    either for "nobody writes" and freed them while a claimed WRITE could still land)."""
    role = peer_role("unsettled_withdraw", {
        "PD_NIXL_MODE": "push", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "1",
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "5"}, {"max_write_s": 3.0})
    got = {e.get("case"): e for e in (role.next_event(timeout_s=120) for _ in range(3))}
    assert set(got) == {"withdrawn", "evicted", "registry gone"}, got
    assert got["withdrawn"]["state"] == KV_POLL_FAILED, got
    assert "no KV from the prefill" in got["withdrawn"]["failure"], got
    assert got["withdrawn"]["took_s"] < 2.0, got
    for case in ("evicted", "registry gone"):
        assert got[case]["state"] == KV_POLL_FAILED, got[case]
        assert "could not say whether the prefill claimed them" in got[case]["failure"], got[case]
        assert got[case]["took_s"] >= 2.9, got[case]  # its pages kept MAX_WRITE_S
    assert "404" in got["evicted"]["failure"] and "no answer" in got["registry gone"]["failure"]


def test_a_pull_room_that_fails_leaves_a_tombstone_and_no_lease(peer_role):
    """A pd-nixl pull prefill whose republication fails (a stalled registry call, injected):
    SGLang frees a failed room's pages, so the lease goes and the record becomes a tombstone
    (before, both stayed: a decode could READ the freed pages, reused by another request by
    then). The decode that waited for the room then fails at once with the lease's end."""
    role = peer_role("failed_republish", {"PD_NIXL_LEASE_S": "2",
                                          "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "15",
                                          "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5"})
    sender = role.next_event(timeout_s=120)
    assert sender.get("event") == "sender", sender
    assert sender["state"] == KV_POLL_FAILED and "did not answer PUT" in sender["failure"], sender
    assert sender["publications"] == 2, sender
    assert sender["record"] == {"expired": True} and sender["lease_until"] == 0.0, sender
    receiver = role.next_event(timeout_s=60)
    assert receiver["state"] == KV_POLL_FAILED and "lease ran out" in receiver["failure"], receiver
    assert receiver["took_s"] < 5, receiver


def test_push_notes_count_only_from_the_room_s_prefill_and_with_digests(peer_role):
    """pd-nixl push: any NIXL peer can notify a decode. A WRITE notification from an agent
    other than the room's prefill is never parsed or kept (a 3-field one without digests had
    completed the room as `unverified`, its metadata row set, the pages never written; an 8 MiB
    one was parsed whole); the prefill's real WRITE then lands verified. A prefill whose record
    says host KV must state digests: a note of its own agent without them fails the room; one
    larger than a note of its room can be is not parsed."""
    role = peer_role("push_notes", {"PD_NIXL_MODE": "push"})
    spoofed = role.next_event(timeout_s=120)
    assert spoofed.get("event") == "spoofed", spoofed
    assert spoofed["state"] != KV_POLL_SUCCESS and spoofed["state"] != KV_POLL_FAILED, spoofed
    assert spoofed["aux_unchanged"] and spoofed["refused"] == 2, spoofed
    written = role.next_event(timeout_s=60)
    assert written["state"] == KV_POLL_SUCCESS and written["sent"] == KV_POLL_SUCCESS, written
    assert written["kv_verdict"] == "verified" and written["same"], written
    undigested = role.next_event(timeout_s=60)
    assert undigested["state"] == KV_POLL_FAILED, undigested
    assert "states none: not used" in undigested["failure"], undigested
    assert undigested["awaited"] == 0 and undigested["arrivals"] == 0, undigested
    oversized = role.next_event(timeout_s=60)  # the prefill's agent, 1 MiB for a 1-page room
    assert oversized["state"] not in (KV_POLL_SUCCESS, KV_POLL_FAILED), oversized
    assert oversized["refused"] == 1, oversized


def test_pull_done_counts_only_from_the_room_s_reader(peer_role):
    """pd-nixl pull: a DONE from a NIXL agent that did not start the room's READ does not end
    it (it had: the prefill freed the pages before any decode read them); the decode's own READ
    does."""
    role = peer_role("pull_notes", {"PD_NIXL_LEASE_S": "60"})
    spoofed = role.next_event(timeout_s=120)
    assert spoofed.get("event") == "spoofed", spoofed
    assert spoofed["state"] != KV_POLL_SUCCESS and spoofed["state"] != KV_POLL_FAILED, spoofed
    read = role.next_event(timeout_s=60)
    assert (read["received"], read["sent"]) == (KV_POLL_SUCCESS, KV_POLL_SUCCESS), read
    assert read["same"], read


def test_a_failed_or_aborted_pd_shm_room_releases_the_pages_it_published(peer_role):
    """pd-shm: a room that fails on a later chunk (no free pool slot) or is aborted after a first
    chunk ends the hold of the pages it published (they had kept pool slots for PD_SHM_HOLD_S,
    60 s by default, though no decode would read them)."""
    role = peer_role("shm_failed_rooms", {"PD_SHM_HOLD_S": "600"})
    for case in ("later chunk fails", "aborted"):
        got = role.next_event(timeout_s=120)
        assert got.get("case") == case, got
        assert got["first_chunk"] == [KV_POLL_TRANSFERRING, 2], got  # published, held
        assert got["state"] == KV_POLL_FAILED, got
        assert ("no free slot" if case != "aborted" else "aborted") in got["failure"], got
        assert got["held_after"] == 0, got
