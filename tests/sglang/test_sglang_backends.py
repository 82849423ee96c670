"""pd-plugins' SGLang backends (`pd-shm`, `pd-nixl`) with the real SGLang package (0.5.23, in
.venv-sglang).

Each engine role is its own process (tests/sglang/sglang_roles.py) that uses SGLang's plugin
loader, argument parser, `get_kv_class` and KV lifecycle; real bytes move through a real
shared-memory pool or over real NIXL (UCX on loopback) and are checked page by page with SHA-256
digests. SGLang's engine itself
does not run on a CPU machine, so nothing here schedules a model.
"""

from __future__ import annotations

import os
import time

import pytest

from pd_plugins.testing.processes import free_port
from pd_plugins.testing.sglang_env import SGLANG_PYTHON
from pd_plugins.transfer.shm_pool import remove_pool
from tests.e2e.deployments import FULL_MATRIX_ONLY
from tests.sglang.role_forkserver import ForkedRole

pytestmark = pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                reason="no .venv-sglang: run `make bootstrap` (scripts/bootstrap.sh)")

KV_POLL_FAILED, KV_POLL_SUCCESS = 0, 4
PAGE_SIZE = 4  # tokens per page in sglang_roles.py


@pytest.fixture
def pool_env(tmp_path):
    path = f"/dev/shm/pd-test-sglang-{os.getpid()}-{tmp_path.name}"
    env = {**os.environ, "PD_SHM_POOL": path, "PD_SHM_POOL_GB": "0.05", "PD_SHM_HOLD_S": "30",
           "SGLANG_PLUGINS": "pd_plugins", "PYTHONWARNINGS": "ignore", "UCX_NET_DEVICES": "lo",
           # pd-nixl: a slow test host can take many seconds to start a decode process
           "PD_NIXL_LEASE_S": "120"}
    yield env
    remove_pool(path)


@pytest.fixture
def roles(forkserver):
    started: list[ForkedRole] = []

    def start(env, role, spec=None) -> ForkedRole:
        started.append(forkserver.start(env, role, spec))
        return started[-1]

    yield start
    for role in started:
        role.stop()


# "pd-nixl:push" is SGLang's backend pd-nixl with PD_NIXL_MODE=push in both processes
BACKENDS = ["pd-shm", "pd-nixl", "pd-nixl:push"]


def variant(env: dict, backend: str) -> tuple[dict, str]:
    """(environment, SGLang backend name) of a BACKENDS entry."""
    name, _, mode = backend.partition(":")
    return ({**env, "PD_NIXL_MODE": mode} if mode else env), name
PAGE_BYTES = 2 * 2 * 256  # 2 layers x (K, V) x 256-byte items


def test_sglang_accepts_and_resolves_the_backends(pool_env, roles):
    registration = roles(pool_env, "registration")
    for backend, prefix in (("pd-shm", "PdShm"), ("pd-nixl", "PdNixl")):
        got = registration.next_event()
        assert got["backend"] == backend  # SGLang's own parser took the name
        assert got["classes"] == {"kvargs": "KVArgs", "manager": f"{prefix}KVManager",
                                  "sender": f"{prefix}KVSender",
                                  "receiver": f"{prefix}KVReceiver",
                                  "bootstrap_server": "RegistryBootstrapServer"}
        assert got["schedulers"] == {"prefill": f"{prefix}KVSender", "decode": f"{prefix}KVSender"}
        assert got["nixl_manager"] == "NixlKVManager"  # SGLang's own backends untouched
        assert got["registered_again"] == ["pd-shm", "pd-nixl"] and got["hooks"] == 1


@pytest.fixture(scope="module")
def startup_events(forkserver):
    """The managers' start-time checks, run in one process: its events by name."""
    path = f"/dev/shm/pd-test-sglang-{os.getpid()}-startup"
    env = {**os.environ, "PD_SHM_POOL": path, "PD_SHM_POOL_GB": "0.01",
           "SGLANG_PLUGINS": "pd_plugins", "PYTHONWARNINGS": "ignore"}
    role = forkserver.start(env, "startup")
    try:
        yield {e.pop("event"): e for e in (role.next_event() for _ in range(4))}
    finally:
        role.stop()
        remove_pool(path)


def test_device_kv_goes_to_pd_nixl_only(startup_events):
    got = startup_events["device_memory"]
    assert got["memory"]["cpu"] == ["DRAM", 0]
    assert got["memory"]["cuda"] == ["VRAM", 3]  # NIXL's memory type, SGLang's gpu_id
    assert got["memory"]["None"] == ["DRAM", 0]  # --device omitted: what torch sees (no GPU here)
    assert got["memory"]["npu"].startswith("NotImplementedError") and "'npu'" in got["memory"]["npu"]
    # pd-shm copies pages through host memory: a CUDA engine gets a clear refusal naming pd-nixl
    assert got["shm_on_cuda"].startswith("NotImplementedError") and "pd-nixl" in got["shm_on_cuda"]
    # pages are addressed by pointer arithmetic, the same on host and device memory, and they are
    # where the engine's own rows are; device KV gets no host views and no host copies
    assert got["host_ranges"] == got["row_views"] == got["device_ranges"]
    assert got["device_row_views"] == 0
    assert got["gather_on_device"].startswith("RuntimeError") and "VRAM" in got["gather_on_device"]


def test_pd_shm_verification_follows_the_pool(startup_events):
    """PD_VERIFY_KV at start: `off` creates a file pool without checksums; `required` refuses
    that pool (saying how to fix it), `on` uses it (its rooms are then unverified); a pool
    created under `on` has checksums. Faults need PD_KV_FAULTS_ALLOWED=1."""
    got = startup_events["pool_verification"]
    assert got["off"] is False
    assert got["required"].startswith("PoolError") and "has no checksums" in got["required"]
    assert "pd-pool remove" in got["required"] and "`required`" in got["required"]
    assert got["on_existing"] is False and got["on_new"] is True
    assert got["faults"].startswith("OptionError") and "PD_KV_FAULTS_ALLOWED=1" in got["faults"]


def test_a_model_with_state_buffers_is_refused_at_the_start(startup_events):
    """Issue 29: Mamba state and sliding-window rings are not pages; both backends refuse such a
    model when the engine builds its KV manager, naming the state kinds and what to use."""
    for backend, why in startup_events["state_refusal"]["refused"].items():
        assert why.startswith(f"NotImplementedError: {backend} moves paged KV only"), why
        assert "(mamba, swa)" in why and "mooncake or nixl" in why, why


def test_a_malformed_peer_record_fails_its_room_and_never_the_scheduler(startup_events):
    """A rank record or push target without its fields, or with fields of the wrong shape (from
    any holder of the peer secret), fails that one room; it used to escape poll() and stop
    SGLang's scheduler."""
    outcomes = startup_events["malformed_peer_records"]["outcomes"]
    assert len(outcomes) == 5
    for name, got in outcomes.items():
        assert got.startswith("failed: "), f"{name}: {got}"
    assert "agent_metadata" in outcomes["pd-nixl receiver"]
    assert "scope" in outcomes["pd-shm receiver"]
    # a push prefill's failed room forgets its lease (SGLang neither aborts nor clears it)
    kept = startup_events["malformed_peer_records"]["leases_kept"]
    assert kept and not any(kept.values()), kept


def start_prefill_ranks(roles, env, backend, rooms, tp_size: int, **spec):
    """A prefill instance of `tp_size` ranks, one process each (started at once: a start costs
    ~15 s of imports), that has published `rooms` on every rank: (its Roles by rank, its bootstrap
    port, per rank: room -> the published event with the pages' digests)."""
    port = free_port()
    env, backend = variant(env, backend)
    ranks = [roles(env, "prefill", {"bootstrap_port": port, "backend": backend, "then_sleep_s": 120,
                                    "rooms": rooms, "tp_size": tp_size, "engine_rank": rank,
                                    "registry": rank == 0, **spec})
             for rank in range(tp_size)]
    published = []
    for prefill in ranks:
        assert prefill.next_event()["event"] == "ready"
        published.append({e["room"]: e for e in (prefill.next_event() for _ in rooms)})
    return ranks, port, published


def start_prefill(roles, env, backend, rooms, **spec):
    """A TP 1 prefill process that has published `rooms`: (its ForkedRole, its bootstrap port,
    room -> the published event with the pages' digests)."""
    (prefill,), port, (published,) = start_prefill_ranks(roles, env, backend, rooms, 1, **spec)
    return prefill, port, published


def receive(roles, env, backend, port, room, dest, aux_index, **spec) -> dict:
    """One room into a fresh decode process: its "received" event."""
    return receive_rooms(roles, env, backend, port, [
        {"room": room, "dest": dest, "aux_index": aux_index, **spec}])[0]


def start_decode(roles, env, backend, port, jobs: list[dict], **spec) -> ForkedRole:
    """A decode process that receives `jobs` one after another (one KV manager, as in an engine).
    `spec`: more of the decode's spec (tp_size, engine_rank)."""
    env, backend = variant(env, backend)
    return roles(env, "decode", {"bootstrap_port": port, "backend": backend, "receives": jobs,
                                 **spec})


def received_events(decode: ForkedRole, jobs: list[dict]) -> list[dict]:
    """The "received" event of each job, in order (past each "bootstrapped")."""
    received = []
    for _ in jobs:
        got = decode.next_event()
        received.append(decode.next_event() if got["event"] == "bootstrapped" else got)
    return received


def receive_rooms(roles, env, backend, port, jobs: list[dict], **spec) -> list[dict]:
    """Rooms one after another into one decode process: the "received" event of each. A process
    start costs ~15 s of imports, so tests share them."""
    return received_events(start_decode(roles, env, backend, port, jobs, **spec), jobs)


def receive_rooms_ranks(roles, env, backend, port, jobs: list[dict], tp_size: int,
                        **spec) -> list[list[dict]]:
    """The same rooms into each rank of a decode instance of `tp_size` ranks, one process each
    (started at once): per rank, the "received" event of each room."""
    decodes = [start_decode(roles, env, backend, port, jobs, tp_size=tp_size, engine_rank=rank,
                            **spec) for rank in range(tp_size)]
    return [received_events(decode, jobs) for decode in decodes]


def sent_events(prefill, count: int) -> dict:
    return {e["room"]: e for e in (prefill.next_event() for _ in range(count))}


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_moves_between_two_processes(backend, pool_env, roles):
    """Two rooms with different KV, published in order, into one decode one after the other: each
    arrives whole and is its own room's KV (a decode served the first or the latest room's pages
    for both would fail one of the digest checks)."""
    pages, rooms = [3, 4, 5, 9, 10, 11], [(1 << 62) + 17, 424242]
    prefill, port, published = start_prefill(roles, pool_env, backend, [
        {"room": rooms[0], "pages": pages, "chunks": 3, "aux_index": 2},
        # its own pages: a pull prefill keeps room 0's pages until they are read
        {"room": rooms[1], "pages": [20, 21], "chunks": 1, "aux_index": 3}])
    assert published[rooms[0]]["kv"][:2] != published[rooms[1]]["kv"]
    assert published[rooms[0]]["aux"] != published[rooms[1]]["aux"]

    # the whole room into other pages; then the second room after a cached first page
    whole, after_prefix = receive_rooms(roles, pool_env, backend, port, [
        {"room": rooms[0], "dest": [40, 41, 42, 50, 51, 52], "aux_index": 7},
        {"room": rooms[1], "dest": [60], "aux_index": 0, "prefix_len": PAGE_SIZE}])
    assert whole["state"] == KV_POLL_SUCCESS, whole
    # pd-nixl lowers the threads NIXL starts (its progress thread polls without pause)
    assert (19 in whole["thread_nice"]) == backend.startswith("pd-nixl"), whole["thread_nice"]
    assert whole["kv"] == published[rooms[0]]["kv"] and whole["aux"] == published[rooms[0]]["aux"]
    if backend == "pd-shm":  # 6 pages + manifest: hold ended, data kept; the other room held
        assert (whole["pool_after"]["ready"], whole["pool_after"]["held"]) == (7 + 3, 3)
    assert after_prefix["state"] == KV_POLL_SUCCESS, after_prefix
    assert after_prefix["kv"] == published[rooms[1]]["kv"][1:]
    assert after_prefix["aux"] == published[rooms[1]]["aux"]

    sent = sent_events(prefill, 2)  # pd-nixl: only once the decodes' reads (writes) are done
    assert [sent[r]["state"] for r in rooms] == [KV_POLL_SUCCESS] * 2, sent
    assert sent[rooms[0]]["metric"]["transfer_total_bytes"] == len(pages) * PAGE_BYTES


@pytest.mark.parametrize("backend", BACKENDS)
def test_aborted_unsent_and_expired_rooms_end_in_failed(backend, pool_env, roles):
    """The ways a room fails while both engines live, on one prefill and one decode: an abort
    (both sides say so), no KV by the decode's waiting timeout, and (pd-nixl) a lease that ran out
    before any decode came (the prefill frees the room and says why; a decode that comes later
    fails at once instead of reading freed pages, or in push waiting for a write that never comes)."""
    nixl = backend.startswith("pd-nixl")
    rooms = [{"room": 3, "pages": [1], "aux_index": 0, "abort": True}]
    if nixl:
        rooms.append({"room": 12, "pages": [2, 3], "aux_index": 1})
    prefill, port, _ = start_prefill(roles, {**pool_env, "PD_NIXL_LEASE_S": "2"}, backend, rooms)
    sent = sent_events(prefill, len(rooms))
    assert sent[3]["state"] == KV_POLL_FAILED and "aborted" in sent[3]["failure"]
    if nixl:
        assert sent[12]["state"] == KV_POLL_FAILED and "within the lease" in sent[12]["failure"]

    start = time.monotonic()
    jobs = [{"room": 3, "dest": [1], "aux_index": 0, "abort": True},
            {"room": 99, "dest": [1], "aux_index": 0}]
    if nixl:
        jobs.append({"room": 12, "dest": [5, 6], "aux_index": 1})
    got = receive_rooms(roles, {**pool_env, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "2"},
                        backend, port, jobs)
    assert got[0]["state"] == KV_POLL_FAILED and "aborted" in got[0]["failure"], got[0]
    assert got[1]["state"] == KV_POLL_FAILED
    assert got[1]["failure"].startswith("TimeoutError: room 99: no KV from the prefill"), got[1]
    # what SGLang's decode queue reads of a failed room is there (its AttributeError had stopped
    # the decode's scheduler on every failed room), and the room says it concluded failed
    assert all(g["decode_queue_reads"] == "ok" and g["concluded"] == KV_POLL_FAILED
               for g in got), got
    assert time.monotonic() - start < 90
    if nixl:
        assert got[2]["state"] == KV_POLL_FAILED and "lease ran out" in got[2]["failure"], got[2]


# push in the full matrix only: a dead peer is found by the same registry heartbeat and NIXL
# check as in pull (about 20 s of process starts in CI)
@pytest.mark.parametrize("backend", ["pd-shm", "pd-nixl",
                                     pytest.param("pd-nixl:push", marks=FULL_MATRIX_ONLY)])
def test_a_dead_prefill_fails_the_decode(backend, pool_env, roles):
    prefill, port, _ = start_prefill(roles, pool_env, backend, [])
    env, name = variant({**pool_env, "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.3"}, backend)
    decode = roles(env, "decode", {"bootstrap_port": port, "backend": name, "room": 100,
                                   "dest": [1], "aux_index": 0})
    assert decode.next_event()["event"] == "bootstrapped"
    prefill.stop()  # SIGKILL: its bootstrap registry goes with it
    got = decode.next_event()
    assert got["state"] == KV_POLL_FAILED
    # the registry's heartbeat, or (pd-nixl) NIXL's own view of the peer
    assert got["failure"].startswith("ConnectionError")
    assert "is gone" in got["failure"] or "Disconnect" in got["failure"], got


def test_a_decode_that_does_not_fit_its_prefill_fails_clearly(pool_env, roles):
    """Each refusal names its reason: another mode of pd-nixl, another backend, another peer
    secret (the prefill's registry answers only calls signed with the shared secret, here the
    per-host default one), and no registry at all."""
    _, port, _ = start_prefill(roles, pool_env, "pd-nixl", [])
    got = receive(roles, pool_env, "pd-nixl:push", port, 1, [1], 0)
    assert got["state"] == KV_POLL_FAILED, got
    assert "runs pd-nixl in pull mode, this decode in push mode" in got["failure"], got

    other_backend, no_registry = receive_rooms(
        roles, {**pool_env, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "1"}, "pd-shm", port, [
            {"room": 1, "dest": [1], "aux_index": 0},
            {"room": 1, "dest": [1], "aux_index": 0, "bootstrap_port": free_port(),
             "bootstrap_s": 30}])
    assert other_backend["state"] == KV_POLL_FAILED, other_backend
    assert "runs transfer backend 'pd-nixl'" in other_backend["failure"], other_backend
    assert no_registry["state"] == KV_POLL_FAILED
    assert "bootstrap timed out" in no_registry["failure"], no_registry
    assert "unreachable" in no_registry["failure"], no_registry

    got = receive(roles, {**pool_env, "PD_PEER_SECRET": "not-the-prefill-s-secret"}, "pd-nixl",
                  port, 1, [1], 0)
    assert got["state"] == KV_POLL_FAILED, got
    assert got["failure"].startswith("PermissionError") and "bad signature" in got["failure"], got


# pd-nixl in the full matrix only (~60 s of process starts in CI): the refusal is host_kv.py's,
# shared by both backends, which pd-shm's two cases prove in CI
@pytest.mark.parametrize("backend", ["pd-shm", pytest.param("pd-nixl", marks=FULL_MATRIX_ONLY)])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)], ids=["P1-D2", "P2-D1"])
def test_a_decode_of_another_tp_size_is_refused_at_its_first_bootstrap(prefill_tp, decode_tp,
                                                                      backend, pool_env, roles):
    """Issue 29: pd-shm and pd-nixl pair prefill rank k with decode rank k. A decode whose TP size
    is not the prefill's: a rank that finds a record of another TP (P1->D2 rank 0, P2->D1) or no
    record of its number (P1->D2 rank 1) fails at once with a message naming both sizes and the
    supported combination, not at the bootstrap timeout and not with "KV items differ"."""
    _, port, _ = start_prefill_ranks(roles, pool_env, backend, [], prefill_tp)
    env = {**pool_env, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60"}
    # each decode rank waits 10 s for the bootstrap (receive_room), far less than its timeout
    for (got,) in receive_rooms_ranks(roles, env, backend, port,
                                      [{"room": 1, "dest": [1], "aux_index": 0}], decode_tp):
        assert got["state"] == KV_POLL_FAILED, got
        assert f"attention TP {prefill_tp}, this decode TP {decode_tp}" in got["failure"], got
        assert "equal TP sizes only" in got["failure"], got


# pd-nixl in the full matrix only (~20 s of process starts): the rank pairing is host_kv.py's,
# which pd-shm's run proves in CI
@pytest.mark.parametrize("backend", ["pd-shm", pytest.param("pd-nixl", marks=FULL_MATRIX_ONLY)])
def test_tp2_prefill_ranks_move_kv_to_the_same_decode_ranks(backend, pool_env, roles):
    """Issue 29, P2->D2: a TP 2 prefill and a TP 2 decode (a process per rank) move two rooms;
    each decode rank gets its own prefill rank's KV and metadata row (the ranks' bytes differ, so
    a rank given the other rank's pages, or one rank's pages for both, fails a digest check)."""
    rooms = [{"room": 5, "pages": [1, 2, 3], "chunks": 2, "aux_index": 1},
             {"room": 6, "pages": [7], "aux_index": 2}]
    prefills, port, published = start_prefill_ranks(roles, pool_env, backend, rooms, 2)
    for room in (5, 6):
        assert not set(published[0][room]["kv"]) & set(published[1][room]["kv"])
        assert published[0][room]["aux"] != published[1][room]["aux"]

    jobs = [{"room": 5, "dest": [10, 11, 12], "aux_index": 3},
            {"room": 6, "dest": [20], "aux_index": 4}]
    for rank, got in enumerate(receive_rooms_ranks(roles, pool_env, backend, port, jobs, 2)):
        for job, event in zip(jobs, got):
            assert event["state"] == KV_POLL_SUCCESS, (rank, event)
            assert event["kv"] == published[rank][job["room"]]["kv"], (rank, job["room"])
            assert event["aux"] == published[rank][job["room"]]["aux"], (rank, job["room"])
    for prefill in prefills:  # pd-nixl: once that rank's decode has read its pages
        sent = sent_events(prefill, len(rooms))
        assert [sent[r]["state"] for r in (5, 6)] == [KV_POLL_SUCCESS] * 2, sent


# per backend: the faults (kind, room numbers from, rooms, which side injects) and the failure
FAULTS = {
    "pd-nixl": [("corrupt", 71000, 50, "decode")],
    "pd-nixl:push": [("corrupt", 71000, 25, "decode"), ("drop_write", 72000, 25, "prefill")],
    "pd-shm": [("flip_slot", 73000, 25, "prefill"), ("reuse", 74000, 25, "decode")],
}
MISMATCH = {"pd-nixl": "KV digest mismatch at page", "pd-nixl:push": "KV digest mismatch at page",
            "pd-shm": "does not match what the prefill published"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_injected_kv_fault_is_caught_by_the_page_digests(backend, pool_env, roles):
    """Issue 28, one prefill and one decode: 50 rooms whose KV is damaged by PD_KV_FAULTS each
    end Failed with a mismatch, and the 10 clean rooms among them arrive verified and whole.
    pd-nixl: `corrupt` (a byte of a landed page, on the decode); push also `drop_write` (the
    prefill's notification without its WRITE, so the decode's pages keep what they held).
    pd-shm: `flip_slot` (the prefill flips a byte of a page it published: the pool's checksum)
    and `reuse` (a page's slot reused between the decode's pin and copy: the generation). The
    faults are targeted by room number, the processes count what they injected, and injected ==
    detected exactly. The decode receives all rooms at once, as its scheduler would."""
    faults = FAULTS[backend]
    faulted = [base + i for _, base, count, _ in faults for i in range(count)]
    clean = [10000 + i for i in range(10)]
    order = []  # clean rooms between faulted ones: a fault must hit its own room only
    for i, room in enumerate(faulted):
        order.append(room)
        if i % 5 == 2:
            order.append(clean[i // 5])
    assert sorted(order) == sorted(faulted + clean)
    env = {**pool_env, "PD_KV_FAULTS_ALLOWED": "1",
           "PD_KV_FAULTS": ";".join(f"{kind}:match=room:{base // 1000}"
                                    for kind, base, _, _ in faults)}
    # every other clean room after a cached first page (the decode checks the digests' tail)
    jobs = []
    for i, room in enumerate(order):
        cached = room in clean and clean.index(room) % 2
        jobs.append({"room": room, "dest": [2 * i + 1] if cached else [2 * i, 2 * i + 1],
                     "aux_index": i % 16, "prefix_len": PAGE_SIZE if cached else 0})
    port, (env, name) = free_port(), variant(env, backend)
    # two pages a room, each room its own pages on the prefill (pull holds them until read);
    # both processes start at once (imports take ~15 s each), the decode waits for the registry
    prefill = roles(env, "prefill", {
        "bootstrap_port": port, "backend": name, "then_sleep_s": 120, "num_pages": 2 * len(order),
        "rooms": [{"room": room, "pages": [2 * i, 2 * i + 1], "aux_index": i % 16}
                  for i, room in enumerate(order)]})
    decode = roles(env, "decode", {"bootstrap_port": port, "backend": name, "receives": jobs,
                                   "together": True, "num_pages": 2 * len(order)})
    assert prefill.next_event()["event"] == "ready"
    published = {e["room"]: e for e in (prefill.next_event() for _ in order)}
    events = [decode.next_event() for _ in jobs]  # in the order the rooms concluded
    got = {e["room"]: e for e in events}

    for room in faulted:
        assert got[room]["state"] == KV_POLL_FAILED, got[room]
        assert f"room {room}: " in got[room]["failure"], got[room]
        assert MISMATCH[backend] in got[room]["failure"], got[room]
    if backend == "pd-shm":  # each fault caught by the check that exists for it
        for kind, base, count, _ in faults:
            why = "bytes changed in the pool" if kind == "flip_slot" else "reused while it was"
            assert all(why in got[base + i]["failure"] for i in range(count)), kind
    for room, job in zip(order, jobs):
        if room in clean:
            assert got[room]["state"] == KV_POLL_SUCCESS, got[room]
            assert got[room]["kv_verdict"] == "verified", got[room]
            skipped = job["prefix_len"] // PAGE_SIZE
            assert got[room]["kv"] == published[room]["kv"][skipped:], room
            assert got[room]["aux"] == published[room]["aux"], room
    sent = sent_events(prefill, len(order))
    assert all(e["state"] == KV_POLL_SUCCESS for e in sent.values()), sent  # reads/writes done
    decoded = events[-1]  # each process's counters as its last event saw them
    for kind, _, count, side in faults:
        counted = (decoded["faults_injected"][kind] if side == "decode"
                   else max(e["faults_injected"][kind] for e in sent.values()))
        assert counted == count, kind
    assert len(faulted) == decoded["kv_checks"]["mismatched"] >= 50
    assert decoded["kv_checks"] == {"verified": len(clean), "mismatched": len(faulted),
                                    "unverified": 0}
