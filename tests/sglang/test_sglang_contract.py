"""SGLang's own scheduler queues over pd-plugins' KV manager, sender and receiver, with the real
SGLang package (.venv-sglang): the events come from the `contract` role
(tests/sglang/sglang_contract.py says what is real there and what is a stand-in).

The role tests (test_sglang_backends.py) drive our classes the way SGLang's queues do, which
missed what the queues read of them: SGLang 0.5.23's DecodePreallocQueue.add reads
`kv_manager.prefill_info_table` for every new request (the decode engine died on its first one),
and `_init_kv_manager` hands the manager `system_dp_rank` None without a DP controller (both
engines died at startup). Here SGLang's code itself makes our managers and calls them.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from pd_plugins.patches import sglang_backends
from pd_plugins.testing.sglang_env import REPO, SGLANG_PYTHON
from pd_plugins.transfer.shm_pool import remove_pool

pytestmark = pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                reason="no .venv-sglang: run `make bootstrap` (scripts/bootstrap.sh)")

BACKENDS = ("pd-shm", "pd-nixl")
KV_POLL_FAILED, KV_POLL_BOOTSTRAPPING, KV_POLL_WAITING = 0, 1, 2


@pytest.fixture(scope="module")
def contract():
    """The contract role's events: {name: event} and {(name, backend): event}."""
    path = f"/dev/shm/pd-test-sglang-{os.getpid()}-contract"
    env = {**os.environ, "PD_SHM_POOL": path, "PD_SHM_POOL_GB": "0.05",
           "SGLANG_PLUGINS": "pd_plugins", "PYTHONWARNINGS": "ignore", "UCX_NET_DEVICES": "lo"}
    try:
        done = subprocess.run([str(SGLANG_PYTHON), "-m", "tests.sglang.sglang_roles", "contract"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    finally:
        remove_pool(path)
    events = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            events[(event.pop("event"), event.pop("backend", None))] = event
    assert ("done", None) in events, done.stderr[-3000:]
    return events


def no_error(event: dict) -> dict:
    assert "error" not in event, f"{event['error']}\n{event.get('traceback', '')}"
    return event


def test_the_contract_test_ran_on_a_checked_release(contract):
    """The version gate lists exactly the releases this test checked: the installed one is
    listed (a newer .venv-sglang must pass here before its version joins CHECKED_VERSIONS)."""
    got = contract[("version", None)]
    assert got["checked"] == list(getattr(sglang_backends, "CHECKED_VERSIONS", ())), got
    assert got["found"] in got["checked"], got


@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_builds_our_managers_and_routes_new_requests(backend, contract):
    """SGLang's _init_kv_manager builds both managers (system_dp_rank None: rank 0); its
    DecodePreallocQueue.add takes a request before the prefill's parallel info is known (slow
    path: pending), _resolve_pending_reqs reads it from the registry (try_ensure_parallel_info)
    and inits the receiver, a later add takes the fast path, and the handshake poll over gloo
    finds both receivers WaitingForInput."""
    got = no_error(contract[("decode_queue", backend)])
    assert got["prefill_rank_key"] == got["decode_rank_key"] == "0.0" and got["decode_mode"]
    first = got["first_add"]
    assert (first["queued"], first["pending"], first["state"], first["initialised"]) == \
        (1, 1, KV_POLL_BOOTSTRAPPING, False), first
    resolved = got["resolved"]
    assert resolved["pending"] == 0 and resolved["initialised"], resolved
    assert resolved["state"] == KV_POLL_WAITING, resolved
    assert resolved["info"] == {"dp_size": 1, "attn_tp_size": 1, "follow_bootstrap_room": True}
    second = got["second_add"]
    assert second["pending"] == 0 and second["state"] == KV_POLL_WAITING, second
    assert [r["waiting_for_input"] for r in got["handshake"]] == [True, True], got["handshake"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_whose_prefill_is_unknown_waits_then_fails_with_the_reason(backend, contract):
    """No prefill registered at the request's address: the request stays pending, its receiver
    never bootstraps (it does not know the DP rank yet), and SGLang's abort after its retries
    fails the room naming what the registry answered."""
    got = no_error(contract[("decode_queue", backend)])
    pending = got["unregistered"]
    assert pending["pending"] == 1 and not pending["initialised"], pending
    assert pending["state"] == KV_POLL_BOOTSTRAPPING, pending
    aborted = got["unregistered_aborted"]
    assert aborted["state"] == KV_POLL_FAILED, aborted
    assert "before the prefill's parallel info could be read" in aborted["failure"], aborted
    assert "unreachable" in aborted["failure"], aborted


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_retract_rebootstrap_fails_its_room_clearly(backend, contract):
    got = no_error(contract[("decode_queue", backend)])["rebootstrap"]
    assert got["state"] == KV_POLL_FAILED, got
    assert "retract rebootstrap" in got["failure"], got


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_room_goes_to_the_prefill_dp_replica_its_number_names(backend, contract):
    """A prefill of 2 DP replicas publishes dp_size 2: SGLang's decode queue sends room 7 to
    replica 1 and room 10 to replica 0, and a request's disagg_prefill_dp_rank wins; a prefill
    replica fails a room whose number names the other replica (the decode would never find it)
    unless the request carries its DP rank."""
    got = no_error(contract[("dp_replicas", backend)])
    assert got["prefill_rank_keys"] == ["0.0", "1.0"]
    rooms = got["rooms"]
    assert {rid: r["prefill_rank"] for rid, r in rooms.items()} == \
        {"odd": "1.0", "even": "0.0", "pinned": "0.0"}, rooms
    assert all(r["state"] == KV_POLL_WAITING for r in rooms.values()), rooms
    senders = got["senders"]
    assert senders["room 7 on replica 0"]["state"] == KV_POLL_FAILED, senders
    assert "looks for it on DP rank 1" in senders["room 7 on replica 0"]["failure"], senders
    assert senders["room 7 on replica 1"]["state"] == KV_POLL_WAITING, senders
    assert senders["room 13 pinned to replica 0"]["state"] == KV_POLL_WAITING, senders


@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_prefill_queue_creates_polls_and_inits_our_sender(backend, contract):
    got = no_error(contract[("prefill_queue", backend)])
    assert got["class"] in ("PdShmKVSender", "PdNixlKVSender") and got["max_new_tokens"] == 1
    assert (got["popped"], got["left"], got["state"]) == (1, 0, KV_POLL_WAITING), got
    assert (got["num_pages"], got["aux_index"]) == (3, got["metadata_buffer_index"]), got


@pytest.mark.parametrize("backend", BACKENDS)
def test_configurations_the_backends_cannot_serve_are_refused_at_startup(backend, contract):
    got = no_error(contract[("startup_refusals", backend)])
    assert got.pop("DP replicas, follow_bootstrap_room") == "started"
    assert got.pop("DP replicas, decode") == "started"
    expected = {"attention DP": "attention DP", "attention DP, deprecated spelling": "attention DP",
                "attention CP": "--attn-cp-size", "PP": "--pp-size",
                "prefill_complete": "prefill_complete",
                "DP replicas, round robin": "follow_bootstrap_room",
                "forced DP-rank queries": "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK",
                "staging buffer": "SGLANG_DISAGG_STAGING_BUFFER"}
    assert set(got) == set(expected)
    for name, why in got.items():
        assert why.startswith(f"NotImplementedError: {backend}: "), (name, why)
        assert expected[name] in why and "mooncake or nixl" in why, (name, why)


def test_every_attribute_sglang_reads_of_our_objects_exists(contract):
    """An AST scan of SGLang's queue code (decode.py, prefill.py, the scheduler and its mixins,
    the poll helpers) for attributes read on a kv_manager / kv_mgr, kv_receiver or sender: each
    exists on every manager, receiver and sender built above, both backends, unless SGLang
    reaches it only through hasattr / getattr or it is exempted for a path ours never takes
    (sglang_contract.EXEMPT, each with its reason; none stale)."""
    got = no_error(contract[("attribute_contract", None)])
    assert got["scanned"] > 30, got  # the scan found SGLang's code (not an empty pass)
    assert got["instances"] == {"manager": ["PdNixlKVManager", "PdShmKVManager"],
                                "receiver": ["PdNixlKVReceiver", "PdShmKVReceiver"],
                                "sender": ["PdNixlKVSender", "PdShmKVSender"]}, got["instances"]
    assert got["missing"] == [], "\n".join(got["missing"])
    assert got["stale_exemptions"] == [], got["stale_exemptions"]
