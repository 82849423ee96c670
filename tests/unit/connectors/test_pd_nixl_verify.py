"""Verified NIXL KV (pd_nixl_verify.py): the prefill's digests, their way to the decode (pull: the
digest channel, the `pd` section, the decode scheduler's metadata; push: the notification before
the WRITE, the decode's inbox, the hold), the decode worker's check of what landed (pairing with a
partial local prefix hit, the `corrupt`, `reuse` and `drop_write` faults, unverified loads,
`required`), and the verdict in the answer through vLLM's real scheduler."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch

from pd_plugins.connectors.vllm.block_verifier import BlockVerifier
from pd_plugins.connectors.vllm.kv_verdicts import FAULTS_INJECTED_KEY, KvLoadOutcomes, LoadOutcome
from pd_plugins.connectors.vllm.pd_nixl_guards import LeaseVerdicts
from pd_plugins.connectors.vllm.pd_nixl_stats import PdNixlStats
from pd_plugins.connectors.vllm.pd_nixl_verify import (
    ACCEPTS_DIGESTS_KEY,
    PUSH_DIGESTS_PREFIX,
    DigestChannel,
    DigestInbox,
    DigestPlan,
    LoadVerifier,
    PdNixlWorkerMeta,
    PushDigestSender,
    expected_digests,
    parse_push_digests,
    prompt_completes,
    push_digests_notif,
)
from pd_plugins.transfer import kv_digest
from pd_plugins.transfer.kv_faults import KvFaults
from pd_plugins.vocab.transfer_params import kv_verdict_of, pd_section_of
from tests.unit.connectors.vllm_scheduler import (
    BLOCK_SIZE,
    make_request,
    make_scheduler,
    sample_one_token,
)

pytest.importorskip("vllm")

NUM_BLOCKS = 16
ALLOWED = {"PD_KV_FAULTS_ALLOWED": "1"}


def kv_cache(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, 8, generator=gen) for _ in range(2)]


class Pair:
    """A prefill's and a decode's KV caches; `read` copies blocks as a NIXL READ would."""

    def __init__(self) -> None:
        self.prefill, self.decode = kv_cache(1), kv_cache(2)
        self.prefill_blocks = [3, 9, 4, 12, 0]  # the prefill leg's 5 blocks
        self.stated = BlockVerifier(self.prefill, NUM_BLOCKS).digests(self.prefill_blocks)
        self.stats = PdNixlStats()

    def read(self, local: list[int]) -> None:
        """Upstream's pairing: local[i] <- the tail of the prefill's list."""
        remote = self.prefill_blocks[len(self.prefill_blocks) - len(local):]
        for dst, src in zip(local, remote):
            for mine, theirs in zip(self.decode, self.prefill):
                mine[dst] = theirs[src]

    def verifier(self, faults: str | None = None, layout_why: str | None = None,
                 required: bool = False, inbox: DigestInbox | None = None,
                 senders_of=None) -> LoadVerifier:
        decode = BlockVerifier(self.decode, NUM_BLOCKS)
        return LoadVerifier(lambda: decode, lambda: layout_why, required,
                            KvFaults.from_spec(faults, "test", ALLOWED), self.stats,
                            inbox=inbox, hold_s=2.0, senders_of=senders_of)

    def start(self, verifier: LoadVerifier, req_id: str, local: list[int],
              digests: str | None = "stated", peer_why: str | None = None) -> None:
        encoded = kv_digest.encode(self.stated) if digests == "stated" else digests
        verifier.expect({req_id: (encoded, None if encoded else "no digests")})
        verifier.remember(req_id, local, len(self.prefill_blocks), "prefill-engine", peer_why)

    def count(self, key: str) -> float:
        return sum(self.stats.data.get(key, ()))


def test_a_full_read_and_a_read_after_a_local_prefix_hit_are_verified():
    pair = Pair()
    verifier = pair.verifier()
    pair.read([5, 6, 7, 8, 10])
    pair.start(verifier, "full", [5, 6, 7, 8, 10])
    pair.read([13, 14])  # the decode had the first 3 blocks cached: it reads the last 2
    pair.start(verifier, "partial", [13, 14])
    assert verifier.settle({"full", "partial"}, set()) == set()
    assert verifier.take_invalid() == set()
    assert verifier.take_outcomes().outcomes == {"full": LoadOutcome(5, 0, 0, True),
                                                 "partial": LoadOutcome(2, 0, 0, True)}
    assert pair.count("kv_verified_blocks") == 7 and pair.count("kv_mismatched_blocks") == 0
    assert len(verifier) == 0


def test_a_partial_hit_paired_with_the_head_of_the_list_would_be_caught():
    # the pairing matters: the decode's 2 blocks hold the prefill's first 2 here (wrong KV)
    pair = Pair()
    verifier = pair.verifier()
    for dst, src in zip([13, 14], pair.prefill_blocks[:2]):
        for mine, theirs in zip(pair.decode, pair.prefill):
            mine[dst] = theirs[src]
    pair.start(verifier, "misplaced", [13, 14])
    verifier.settle({"misplaced"}, set())
    assert verifier.take_invalid() == {13, 14}
    assert verifier.take_outcomes().outcomes["misplaced"] == LoadOutcome(2, 2, 2, True)


def test_a_mismatch_at_block_k_invalidates_the_blocks_from_k():
    pair = Pair()
    verifier = pair.verifier()
    local = [5, 6, 7, 8, 10]
    pair.read(local)
    pair.decode[1][7, 0, 3, 2] += 1.0  # block 2 of the read, layer 1
    pair.start(verifier, "bad", local)
    assert verifier.settle({"bad"}, set()) == set()  # blocks, not the request
    assert verifier.take_invalid() == {7, 8, 10}
    assert verifier.take_outcomes().outcomes["bad"] == LoadOutcome(5, 3, 1, True)
    assert verifier.take_mismatched_reads() == 1
    assert pair.count("kv_mismatched_requests") == 1 and pair.count("kv_verified_blocks") == 2


@pytest.mark.parametrize("kind", ["corrupt", "reuse"])
def test_each_landed_block_fault_hits_only_matching_reads_and_is_always_caught(kind):
    # corrupt: one byte of one block flipped; reuse: one block holds another block's bytes
    other = "reuse" if kind == "corrupt" else "corrupt"
    pair = Pair()
    verifier = pair.verifier(f"{kind}:match=kvfault-;{other}:match=nothing-matches")
    ids = [f"cmpl-kvfault-{i}" for i in range(20)] + [f"cmpl-clean-{i}" for i in range(5)]
    local = [5, 6, 7, 8, 10]
    for req_id in ids:
        pair.read(local)
        pair.start(verifier, req_id, local)
        verifier.settle({req_id}, set())
    outcomes = verifier.take_outcomes().outcomes
    assert [r for r, o in outcomes.items() if o.mismatched] == ids[:20]
    assert all(o.mismatched == 1 and o.checked for o in list(outcomes.values())[:20])
    assert pair.count(FAULTS_INJECTED_KEY) == 20 == pair.count("kv_mismatched_requests")
    assert (verifier.faults.injected[kind], verifier.faults.injected[other]) == (20, 0)


def test_reads_without_usable_digests_are_unverified_never_verified():
    pair = Pair()
    verifier = pair.verifier()
    local = [5, 6, 7, 8, 10]
    pair.read(local)
    pair.start(verifier, "none", local, digests=None)
    pair.start(verifier, "garbage", local, digests="not base64!")
    pair.start(verifier, "short", local, digests=kv_digest.encode(pair.stated[:4]))
    pair.start(verifier, "tp2", local, peer_why="the prefill has TP 2")
    verifier.remember("never-expected", local, 5, "p", None)
    done = {"none", "garbage", "short", "tp2", "never-expected"}
    assert verifier.settle(done, set()) == set()
    assert verifier.take_invalid() == set()
    assert all(o == LoadOutcome(5, 0, 0, False)
               for o in verifier.take_outcomes().outcomes.values())
    assert pair.count("kv_unverified_loads") == 5 and pair.count("kv_verified_blocks") == 0
    unsupported = pair.verifier(layout_why="reads land in a host buffer")
    pair.start(unsupported, "host-buffer", local)
    unsupported.settle({"host-buffer"}, set())
    assert unsupported.take_outcomes().outcomes["host-buffer"].checked is False


def test_required_fails_a_read_it_cannot_check_and_still_checks_the_others():
    pair = Pair()
    verifier = pair.verifier(required=True)
    local = [5, 6, 7, 8, 10]
    pair.read(local)
    pair.start(verifier, "unchecked", local, digests=None)
    pair.start(verifier, "checked", local)
    assert verifier.settle({"unchecked", "checked"}, set()) == {"unchecked"}
    outcomes = verifier.take_outcomes().outcomes
    assert outcomes == {"unchecked": LoadOutcome(5, 5, 0, False),
                        "checked": LoadOutcome(5, 0, 0, True)}


def test_failed_and_forgotten_reads():
    pair = Pair()
    verifier = pair.verifier()
    pair.start(verifier, "late", [5, 6])
    pair.start(verifier, "aborted", [7])
    verifier.remember("hit", [], 5, "p", None)  # a full local hit: nothing read, not tracked
    verifier.settle({"late"}, {"late"})  # the lease check failed it: not checked, failed
    assert verifier.take_outcomes().outcomes == {"late": LoadOutcome(2, 2, 0, True)}
    verifier.forget({"aborted"})
    assert len(verifier) == 0


def test_expected_digests_from_a_decodes_params():
    good = {"algo": "ws64", "block_size": BLOCK_SIZE, "ranks": ["AAAAAAAAAAA="]}

    def params(digest):
        return {"pd": {"prompt_tokens": 3, "kv_digest": digest}}

    assert expected_digests(params(good), BLOCK_SIZE) == ("AAAAAAAAAAA=", None)
    for bad, why in [(None, "no digests"), ({"algo": "ws64"}, "malformed"),
                     ({**good, "algo": "xxh3"}, "algorithm"),
                     ({**good, "block_size": 32}, "block size"),
                     ({**good, "ranks": ["a", "b"]}, "TP")]:
        value, reason = expected_digests(params(bad), BLOCK_SIZE)
        assert value is None and why in reason
    assert expected_digests(None, BLOCK_SIZE)[0] is None
    assert expected_digests({"pd": "x"}, BLOCK_SIZE)[0] is None


def test_worker_meta_carries_lease_verdicts_and_load_outcomes_across_ranks():
    a = PdNixlWorkerMeta(LeaseVerdicts([("r1", "agent", True, 0)]),
                         KvLoadOutcomes({"d1": LoadOutcome(3, 0, 0, True)}))
    b = PdNixlWorkerMeta(loads=KvLoadOutcomes({"d1": LoadOutcome(3, 2, 1, True)}))
    a.aggregate(b)
    assert a.lease.verdicts == [("r1", "agent", True, 0)]
    assert a.loads.outcomes["d1"] == LoadOutcome(3, 2, 1, True)  # worst wins


class _Req:
    def __init__(self, computed: int, prompt: int) -> None:
        self.request_id, self.num_computed_tokens, self.num_prompt_tokens = "r", computed, prompt


def test_a_leg_is_digested_in_the_step_its_prompt_completes():
    assert not prompt_completes(_Req(0, 40), 32) and prompt_completes(_Req(32, 40), 8)
    assert not prompt_completes(_Req(40, 40), 0)
    plan = DigestPlan()
    leg = _Req(0, 40)
    plan.track(leg)
    assert plan.due({"r": 32}, lambda r: [1, 2]) == {}  # a chunk of the prompt
    leg.num_computed_tokens = 32
    assert plan.due({"r": 8}, lambda r: [1, 2, 3]) == {"r": [1, 2, 3]}
    assert plan.due({"r": 1}, lambda r: [1, 2, 3]) == {}  # once
    assert plan.forget("r") and not plan.forget("r")  # its worker was asked for its digests
    never = _Req(0, 40)
    never.request_id = "never"
    plan.track(never)
    assert not plan.forget("never")  # finished before its prompt completed: none are coming


def test_digests_travel_from_the_worker_to_the_scheduler():
    engine = f"test-{uuid.uuid4().hex}"
    scheduler, worker = DigestChannel(engine, scheduler=True), DigestChannel(engine, False)
    try:
        verifier = BlockVerifier(kv_cache(3), NUM_BLOCKS)
        worker.send(verifier, {"leg": [4, 2, 9]})
        scheduler.wait_s = 10  # a loaded host's ipc can take longer than an engine waits
        stated, why = scheduler.take("leg", BLOCK_SIZE)
        assert stated.block_size == BLOCK_SIZE and stated.algo == "ws64" and why is None
        assert kv_digest.decode(stated.ranks[0], 3).tolist() == verifier.digests([4, 2, 9]).tolist()
        scheduler.wait_s = 0.2
        started = time.monotonic()
        assert scheduler.take("other", BLOCK_SIZE) == (None, "late")  # waited, none came
        assert scheduler.take("another", BLOCK_SIZE) == (None, "late")  # (not waited out again)
        assert 0.2 <= time.monotonic() - started < 0.35
        time.sleep(0.25)  # the quiet time over, a wait again
        started = time.monotonic()
        assert scheduler.take("a third", BLOCK_SIZE) == (None, "late")
        assert time.monotonic() - started >= 0.2
    finally:
        scheduler.close()
        worker.close()


def test_a_worker_that_cannot_digest_says_so_and_its_scheduler_does_not_wait():
    engine = f"test-{uuid.uuid4().hex}"
    scheduler, worker = DigestChannel(engine, scheduler=True), DigestChannel(engine, False)
    try:
        worker.send(None, {"leg": [4, 2, 9]})  # no verifier (its KV layout is not digestible)
        worker.send(BlockVerifier(kv_cache(3), NUM_BLOCKS), {"cut": None})  # nor these blocks
        scheduler.wait_s = 10
        started = time.monotonic()
        assert scheduler.take("leg", BLOCK_SIZE) == (None, "undigested")
        assert scheduler.take("cut", BLOCK_SIZE) == (None, "undigested")
        assert time.monotonic() - started < 5  # answered, not waited out
        started = time.monotonic()
        assert scheduler.take("unasked", BLOCK_SIZE, asked=False) == (None, "unasked")
        assert time.monotonic() - started < 1  # never asked for: no wait at all
    finally:
        scheduler.close()
        worker.close()


# -- through vLLM's real scheduler --------------------------------------------------------------
def collect_counters(scheduler) -> dict[str, float]:
    """The scheduler side's counters as vLLM collects them (each step's, summed)."""
    totals: dict[str, float] = {}
    collect = scheduler.connector.get_kv_connector_stats

    def collecting():
        stats = collect()
        for key, values in (stats.data.items() if stats is not None else ()):
            if isinstance(values, list) and all(isinstance(v, (int, float)) for v in values):
                totals[key] = totals.get(key, 0) + sum(values)
        return stats

    scheduler.connector.get_kv_connector_stats = collecting
    return totals


PROMPT = list(range(1, 41))  # 40 tokens: blocks of 16, 16 and 8
PREFILL_FLAGS = {"do_remote_decode": True, "do_remote_prefill": False}


def test_a_prefill_leg_answers_with_its_blocks_digests():
    engine = f"prefill-{uuid.uuid4().hex}"
    scheduler = make_scheduler("PdNixlConnector", "kv_producer", {"lease_check_port": 0},
                               engine_id=engine)
    worker = DigestChannel(engine, scheduler=False)
    try:
        request = make_request("leg", [500] + PROMPT[1:], {"kv_transfer_params": PREFILL_FLAGS},
                               max_tokens=1)
        scheduler.add_request(request)
        output = scheduler.schedule()
        due = output.kv_connector_metadata.pd_digest_blocks
        blocks = scheduler.kv_cache_manager.get_block_ids("leg")[0]
        assert due == {"leg": list(blocks)} and len(blocks) == 3
        gen = torch.Generator().manual_seed(4)  # the worker's KV cache (vllm_scheduler: 200)
        verifier = BlockVerifier([torch.randn(200, 2, BLOCK_SIZE, 8, generator=gen)], 200)
        worker.send(verifier, due)  # after the forward pass
        scheduler.connector._digest_channel.wait_s = 10  # a loaded host's ipc can be slow
        finished = sample_one_token(scheduler, output)["leg"]
        params = finished.kv_transfer_params
        section = pd_section_of(params)
        assert section.kv_digest.ranks == [kv_digest.encode(verifier.digests(blocks))]
        assert params["remote_block_ids"][0] == list(blocks)
    finally:
        worker.close()
        scheduler.shutdown()


def test_a_prefill_without_digests_in_time_is_answered_and_counted():
    scheduler = make_scheduler("PdNixlConnector", "kv_producer", {"lease_check_port": 0},
                               engine_id=f"prefill-{uuid.uuid4().hex}")
    try:
        request = make_request("leg", [501] + PROMPT[1:], {"kv_transfer_params": PREFILL_FLAGS},
                               max_tokens=1)
        scheduler.add_request(request)
        counters = collect_counters(scheduler)
        finished = sample_one_token(scheduler, scheduler.schedule())["leg"]
        assert pd_section_of(finished.kv_transfer_params).kv_digest is None
        assert counters["pd_missing_digests"] == 1
    finally:
        scheduler.shutdown()


def test_verify_off_states_no_digests():
    scheduler = make_scheduler("PdNixlConnector", "kv_producer",
                               {"lease_check_port": 0, "verify_kv": "off"})
    try:
        request = make_request("leg", [502] + PROMPT[1:], {"kv_transfer_params": PREFILL_FLAGS},
                               max_tokens=1)
        scheduler.add_request(request)
        output = scheduler.schedule()
        assert output.kv_connector_metadata.pd_digest_blocks == {}
        finished = sample_one_token(scheduler, output)["leg"]
        assert pd_section_of(finished.kv_transfer_params).kv_digest is None
    finally:
        scheduler.shutdown()


def decode_params(digests: str | None) -> dict:
    section = {"prompt_tokens": 40, "cached_tokens": 0, "engine_id": "p", "mode": "pull",
               "block_size": BLOCK_SIZE}
    if digests is not None:
        section["kv_digest"] = {"algo": "ws64", "block_size": BLOCK_SIZE, "ranks": [digests]}
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p",
            "remote_request_id": "leg", "remote_host": "127.0.0.1", "remote_port": 5600,
            "tp_size": 1, "remote_block_ids": [[7, 8, 9]], "pd": section}


def run_decode(policy: str, digests: str | None, outcome: LoadOutcome | None,
               invalid_from: int | None = None):
    """A decode request through vLLM's scheduler; the workers report `outcome` for its read
    (and its blocks from `invalid_from` as load errors). Returns (the metadata's expected
    digests, the finished output, the scheduler's counters)."""
    from vllm.v1.outputs import KVConnectorOutput

    scheduler = make_scheduler("PdNixlConnector", "kv_consumer", failure_policy=policy)
    try:
        request = make_request("dec", PROMPT, {"kv_transfer_params": decode_params(digests)})
        scheduler.add_request(request)
        counters = collect_counters(scheduler)
        output = scheduler.schedule()  # allocates, parks it in WAITING_FOR_REMOTE_KVS
        meta = output.kv_connector_metadata
        expected = meta.pd_expected_digests
        local = list(meta.reqs_to_recv["dec"].local_block_ids[0])
        report = KVConnectorOutput(
            finished_recving={"dec"},
            invalid_block_ids=set(local[invalid_from:]) if invalid_from is not None else set(),
            kv_connector_worker_meta=(PdNixlWorkerMeta(loads=KvLoadOutcomes({"dec": outcome}))
                                      if outcome is not None else None))
        finished = sample_one_token(scheduler, output, kv_connector_output=report)
        for _ in range(8):
            if "dec" in finished:
                break
            output = scheduler.schedule()
            finished.update(sample_one_token(scheduler, output))
        return expected, finished.get("dec"), counters
    finally:
        scheduler.shutdown()


def test_a_verified_read_says_so_in_the_decodes_answer():
    expected, finished, stats = run_decode("recompute", "AAAAAAAAAAA=",
                                           LoadOutcome(3, 0, 0, True))
    assert expected == {"dec": ("AAAAAAAAAAA=", None)}
    verdict = kv_verdict_of(finished.kv_transfer_params)
    assert (verdict.verdict, verdict.blocks, verdict.mismatched) == ("verified", 3, 0)
    assert stats["kv_verdicts_verified"] == 1


def test_a_mismatched_read_is_recomputed_from_its_first_bad_block():
    _, finished, stats = run_decode("recompute", "AAAAAAAAAAA=", LoadOutcome(3, 2, 1, True),
                                    invalid_from=1)
    verdict = kv_verdict_of(finished.kv_transfer_params)
    assert (verdict.verdict, verdict.mismatched) == ("recomputed", 1)
    assert finished.finish_reason is not None and stats["kv_verdicts_recomputed"] == 1


def test_a_mismatched_read_fails_the_request_under_policy_fail():
    _, finished, stats = run_decode("fail", "AAAAAAAAAAA=", LoadOutcome(3, 3, 1, True),
                                    invalid_from=0)
    # vLLM answers a failed request with an error and no kv_transfer_params: only counted
    assert str(finished.finish_reason) in ("error", "FinishReason.ERROR")
    assert kv_verdict_of(finished.kv_transfer_params) is None
    assert stats["kv_verdicts_failed"] == 1


def test_a_read_without_digests_is_unverified():
    expected, finished, _ = run_decode("recompute", None, LoadOutcome(3, 0, 0, False))
    assert expected["dec"][0] is None
    assert kv_verdict_of(finished.kv_transfer_params).verdict == "unverified"


def test_layouts_upstream_post_processes_are_not_checked():
    from types import SimpleNamespace

    from pd_plugins.connectors.vllm.nixl_internals import unverifiable_layout

    # every name is upstream's worker's (nixl_internals.PRIVATE_NAMES), read without a default
    plain = dict(_physical_blocks_per_logical_kv_block=1, use_host_buffer=False,
                 enable_permute_local_kv=False, dcp_size=1, pcp_size=1,
                 enable_heterogeneous_attn_post_process=False)
    assert unverifiable_layout(SimpleNamespace(**plain)) is None
    for change, why in [({"_physical_blocks_per_logical_kv_block": 2}, "kernel blocks"),
                        ({"use_host_buffer": True}, "host buffer"),
                        ({"enable_permute_local_kv": True}, "permuted"),
                        ({"dcp_size": 2}, "context parallelism"),
                        ({"enable_heterogeneous_attn_post_process": True}, "heterogeneous")]:
        assert why in unverifiable_layout(SimpleNamespace(**{**plain, **change}))


# -- push -------------------------------------------------------------------------------------------
class FakeDecodeAgent:
    """A NIXL agent's notification queue (a named fake: what upstream's writer thread fetches)."""

    name = "decode-agent"

    def __init__(self):
        self.notifs: dict[str, list[bytes]] = {}

    def get_new_notifs(self):
        notifs, self.notifs = self.notifs, {}
        return notifs


def test_the_inbox_takes_digest_notifications_out_before_upstream_sees_them():
    agent = FakeDecodeAgent()
    inbox = DigestInbox(agent)
    agent.notifs = {"prefill-a": [b"req-1:1", push_digests_notif("req-1", 0, "AAAAAAAAAAA="),
                                  b"HB:req-9", b"PUSH_REG:x"],
                    "prefill-b": [push_digests_notif("req-2", 0, "BBBBBBBBBBB=")]}
    # upstream parses the rest as "<request id>:<count>" (or heartbeats, registrations)
    assert inbox.get_new_notifs() == {"prefill-a": [b"req-1:1", b"HB:req-9", b"PUSH_REG:x"],
                                      "prefill-b": []}
    assert inbox.name == "decode-agent"
    assert inbox.take("req-1") == "AAAAAAAAAAA=" and inbox.take("req-1") is None
    assert inbox.take("req-2") == "BBBBBBBBBBB="
    # a peer's bytes: malformed, oversized, another rank's (TP 1 only) are dropped and counted
    agent.notifs = {"p": [PUSH_DIGESTS_PREFIX + b"\xc1garbage",
                          PUSH_DIGESTS_PREFIX + b"\x93\x01\x02\x03",
                          push_digests_notif("big", 0, "A" * (1 << 21)),
                          push_digests_notif("rank-1", 1, "AAAAAAAAAAA=")]}
    assert inbox.get_new_notifs() == {"p": []}
    assert inbox.malformed == 4 and len(inbox) == 0
    assert parse_push_digests(push_digests_notif("r", 0, "x")) == ("r", 0, "x")


def test_the_inbox_is_bounded_oldest_forgotten():
    agent = FakeDecodeAgent()
    inbox = DigestInbox(agent, size=3)
    agent.notifs = {"p": [push_digests_notif(f"req-{i}", 0, str(i)) for i in range(5)]}
    inbox.get_new_notifs()
    assert len(inbox) == 3
    assert [inbox.take(f"req-{i}") for i in range(5)] == [None, None, "2", "3", "4"]


def test_the_inbox_is_bounded_in_bytes_too():
    agent = FakeDecodeAgent()
    inbox = DigestInbox(agent, max_bytes=25)
    agent.notifs = {"p": [push_digests_notif(f"req-{i}", 0, "x" * 10) for i in range(4)]}
    inbox.get_new_notifs()
    assert len(inbox) == 2 and inbox.take("req-1") is None and inbox.take("req-3") == "x" * 10


def test_digests_of_a_push_that_ended_unchecked_are_dropped():
    """An aborted or failed push leaves no digests behind (they can be MiBs each)."""
    pair, agent = Pair(), FakeDecodeAgent()
    inbox = DigestInbox(agent)
    verifier = pair.verifier(inbox=inbox)
    for req_id in ("aborted", "failed"):
        push_start(pair, verifier, req_id, [5])
        deliver(agent, inbox, req_id, np.zeros(1, dtype=np.uint64))
    assert len(inbox) == 2
    verifier.forget({"aborted"})
    verifier.settle(set(), {"failed"}, now=0.0)
    assert len(inbox) == 0


def push_start(pair: Pair, verifier: LoadVerifier, req_id: str, local: list[int]) -> None:
    verifier.remember(req_id, local, len(local), "prefill-engine", None, pushed=True)


def deliver(agent: FakeDecodeAgent, inbox: DigestInbox, req_id: str, digests) -> None:
    agent.notifs = {"prefill-agent": [push_digests_notif(req_id, 0, kv_digest.encode(digests))]}
    inbox.get_new_notifs()


def test_a_push_finished_before_its_digests_is_held_until_they_arrive():
    pair, agent = Pair(), FakeDecodeAgent()
    inbox = DigestInbox(agent)
    verifier = pair.verifier(inbox=inbox)
    local = [5, 6, 7, 8, 10]
    pair.read(local)  # what the WRITE landed
    push_start(pair, verifier, "early", local)
    push_start(pair, verifier, "late", local)
    deliver(agent, inbox, "early", pair.stated)  # its digests came before its completion
    finished = {"early", "late"}
    assert verifier.settle(finished, set(), now=100.0) == set()
    assert finished == {"early"}  # `late` waits for its digests
    assert verifier.take_outcomes().outcomes == {"early": LoadOutcome(5, 0, 0, True)}
    finished = set()
    verifier.settle(finished, set(), now=101.0)
    assert finished == set()  # still nothing, still within the wait
    deliver(agent, inbox, "late", pair.stated)
    verifier.settle(finished, set(), now=101.5)
    assert finished == {"late"}
    assert verifier.take_outcomes().outcomes == {"late": LoadOutcome(5, 0, 0, True)}
    assert len(verifier) == 0


def test_only_the_prefills_own_agent_states_a_pushs_digests():
    """Any NIXL peer can send a PDKVD notification: one from another agent, before or after the
    prefill's, replaced them (last wins) and made a good push a mismatch (a recompute); with only
    another agent's, the push is held for the prefill's and then loaded `unverified`."""
    pair, agent = Pair(), FakeDecodeAgent()
    inbox = DigestInbox(agent)
    agents = {"prefill-engine": {"prefill-agent"}}
    verifier = pair.verifier(inbox=inbox, senders_of=lambda engine: agents.get(engine, set()))
    local = [5, 6, 7, 8, 10]
    pair.read(local)
    wrong = kv_digest.encode(pair.stated[::-1].copy())
    for req_id in ("good", "spoofed"):
        push_start(pair, verifier, req_id, local)
    agent.notifs = {"other-agent": [push_digests_notif("good", 0, wrong)],
                    "prefill-agent": [push_digests_notif("good", 0,
                                                         kv_digest.encode(pair.stated))]}
    inbox.get_new_notifs()
    agent.notifs = {"other-agent": [push_digests_notif("good", 0, wrong),  # after the prefill's
                                    push_digests_notif("spoofed", 0, wrong)]}
    inbox.get_new_notifs()
    finished = {"good", "spoofed"}
    verifier.settle(finished, set(), now=100.0)
    assert finished == {"good"} and verifier.take_invalid() == set()
    assert verifier.take_outcomes().outcomes == {"good": LoadOutcome(5, 0, 0, True)}
    finished = set()
    verifier.settle(finished, set(), now=102.0)  # the wait for the prefill's is over
    assert finished == {"spoofed"} and verifier.take_invalid() == set()
    assert verifier.take_outcomes().outcomes == {"spoofed": LoadOutcome(5, 0, 0, False)}
    assert len(inbox) == 0  # the other agent's are dropped with the push


def test_a_push_whose_digests_never_come_is_unverified_or_failed_under_required():
    for required, failed in [(False, set()), (True, {"silent"})]:
        pair = Pair()
        inbox = DigestInbox(FakeDecodeAgent())
        verifier = pair.verifier(inbox=inbox, required=required)
        push_start(pair, verifier, "silent", [5, 6])
        finished = {"silent"}
        assert verifier.settle(finished, set(), now=10.0) == set() and finished == set()
        assert verifier.settle(finished, set(), now=11.9) == set() and finished == set()
        assert verifier.settle(finished, set(), now=12.0) == failed  # the 2 s wait is over
        assert finished == {"silent"}
        outcome = verifier.take_outcomes().outcomes["silent"]
        assert outcome == (LoadOutcome(2, 2, 0, False) if required else
                           LoadOutcome(2, 0, 0, False))
        assert pair.count("kv_unverified_loads") == 1


def test_a_held_push_whose_request_is_aborted_is_reported_finished_once_and_unchecked():
    # vLLM frees an aborted request's blocks only when its receive is reported finished: a push
    # held for its digests and then aborted must still be reported, once, or its blocks leak
    pair = Pair()
    verifier = pair.verifier(inbox=DigestInbox(FakeDecodeAgent()))
    push_start(pair, verifier, "aborted", [5])
    finished = {"aborted"}
    verifier.settle(finished, set(), now=0.0)
    assert finished == set()  # held for its digests
    verifier.forget({"aborted"})  # the client left (the worker forgets, then settles)
    finished = set()
    verifier.settle(finished, set(), now=0.1)
    assert finished == {"aborted"} and verifier.take_outcomes().outcomes == {}
    finished = set()
    verifier.settle(finished, set(), now=5.0)
    assert finished == set()  # once


def test_pushes_are_checked_as_reads_are_and_every_dropped_or_damaged_one_is_caught():
    pair, agent = Pair(), FakeDecodeAgent()
    inbox = DigestInbox(agent)
    verifier = pair.verifier("corrupt:match=kvfault-c", inbox=inbox)
    local = [5, 6, 7, 8, 10]
    ids = ([f"kvfault-c-{i}" for i in range(10)] + [f"kvfault-d-{i}" for i in range(10)]
           + [f"clean-{i}" for i in range(5)])
    for req_id in ids:
        pair.read(local)
        if "-d-" in req_id:  # a dropped WRITE: the decode's blocks keep other bytes
            for layer in pair.decode:
                layer[local] = torch.randn_like(layer[local])
        push_start(pair, verifier, req_id, local)
        deliver(agent, inbox, req_id, pair.stated)
        verifier.settle({req_id}, set())
    outcomes = verifier.take_outcomes().outcomes
    assert [r for r, o in outcomes.items() if o.mismatched] == ids[:20]
    assert [outcomes[r].mismatched for r in ids[:20]] == [1] * 10 + [5] * 10
    assert all(outcomes[r] == LoadOutcome(5, 0, 0, True) for r in ids[20:])
    assert pair.count("kv_mismatched_requests") == 20


class FakePushPrefill:
    """The parts of an upstream push worker a digest sender uses (a named fake)."""

    tp_rank = 0
    world_size = 1

    def __init__(self, agents: dict[str, str]):
        self._handshake_lock = __import__("threading").RLock()
        self._remote_agents = {engine: {(0, 0): name} for engine, name in agents.items()}
        self.sent: list[tuple[str, bytes]] = []
        self.nixl_wrapper = self

    def send_notif(self, agent: str, notif_msg: bytes) -> None:
        self.sent.append((agent, notif_msg))


def registration(engine: str, decode_blocks: list[int], req_id: str = "decode-req") -> dict:
    """A push registration from a decode that asks for digests (a PdNixl decode, verify_kv on)."""
    return {"request_id": req_id, "decode_engine_id": engine, "decode_tp_size": 1,
            "local_block_ids": [decode_blocks], ACCEPTS_DIGESTS_KEY: True}


def test_the_prefill_sends_digests_only_to_a_decode_that_asks_for_them():
    """A decode that does not take PDKVD notifications out (upstream's NixlConnector, an older
    PdNixl, verify_kv off) parsed one as `<id>:<count>` and its engine died: it gets none."""
    pair = Pair()
    worker = FakePushPrefill({"decode-1": "agent-d1"})
    prefill = BlockVerifier(pair.prefill, NUM_BLOCKS)
    sender = PushDigestSender(worker, lambda: prefill, lambda: None, KvFaults.none())
    silent = registration("decode-1", [13, 14])
    del silent[ACCEPTS_DIGESTS_KEY]
    assert sender.before_write("p-1", [pair.prefill_blocks], silent)  # the WRITE still starts
    assert worker.sent == [] and sender.take_counts() == (1, 0)  # a WRITE without digests
    assert sender.before_write("p-2", [pair.prefill_blocks], registration("decode-1", [13, 14]))
    assert len(worker.sent) == 1


PUSH_DECODE_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p",
                      "remote_request_id": "leg", "remote_host": "127.0.0.1", "remote_port": 5600,
                      "tp_size": 1}


@pytest.mark.parametrize("verify", ["on", "off"])
def test_a_push_decode_asks_for_digests_in_its_registration_only_when_it_checks_them(verify):
    from pd_plugins.connectors.vllm.pd_nixl_guards import WRITE_BY_KEY

    scheduler = make_scheduler("PdNixlConnector", "kv_consumer", {"mode": "push",
                                                                  "verify_kv": verify})
    try:
        scheduler.add_request(make_request("dec", PROMPT,
                                           {"kv_transfer_params": dict(PUSH_DECODE_PARAMS)}))
        sent = scheduler.schedule().kv_connector_metadata.push_registrations["dec"]
        assert WRITE_BY_KEY in sent
        assert sent.get(ACCEPTS_DIGESTS_KEY) is (True if verify == "on" else None)
    finally:
        scheduler.shutdown()


def test_the_prefill_sends_the_digests_of_the_blocks_it_writes_once_and_after_the_handshake():
    pair = Pair()
    worker = FakePushPrefill({"decode-1": "agent-d1"})
    prefill = BlockVerifier(pair.prefill, NUM_BLOCKS)
    sender = PushDigestSender(worker, lambda: prefill, lambda: None, KvFaults.none())
    blocks = [pair.prefill_blocks]
    # handshake with decode-2 pending: nothing sent, upstream starts (defers) the WRITE
    assert sender.before_write("p-0", blocks, registration("decode-2", [1, 2, 3, 4, 5]))
    assert worker.sent == []
    # the decode had 3 blocks cached: the WRITE copies the prefill's last 2 into its 2
    assert sender.before_write("p-1", blocks, registration("decode-1", [13, 14]))
    assert sender.before_write("p-1", blocks, registration("decode-1", [13, 14]))  # again
    assert len(worker.sent) == 1
    agent, message = worker.sent[0]
    req_id, rank, encoded = parse_push_digests(message)
    assert (agent, req_id, rank) == ("agent-d1", "decode-req", 0)
    assert list(kv_digest.decode(encoded, 5)) == list(pair.stated[3:])
    assert sender.take_counts() == (0, 0)
    # no pairing (more decode blocks than the prefill's), or an unverifiable layout: no digests
    assert sender.before_write("p-2", blocks, registration("decode-1", list(range(6))))
    unverifiable = PushDigestSender(worker, lambda: prefill, lambda: "host buffer",
                                    KvFaults.none())
    assert unverifiable.before_write("p-3", blocks, registration("decode-1", [1]))
    assert len(worker.sent) == 1
    assert sender.take_counts() == (1, 0) and unverifiable.take_counts() == (1, 0)


def test_drop_write_sends_the_digests_and_the_completion_but_no_write():
    pair = Pair()
    worker = FakePushPrefill({"decode-1": "agent-d1"})
    prefill = BlockVerifier(pair.prefill, NUM_BLOCKS)
    sender = PushDigestSender(worker, lambda: prefill, lambda: None,
                              KvFaults.from_spec("drop_write:match=kvfault-", "test", ALLOWED))
    assert not sender.before_write("cmpl-kvfault-1", [pair.prefill_blocks],
                                   registration("decode-1", [1, 2, 3, 4, 5], "d-kvfault-1"))
    assert sender.before_write("cmpl-clean-1", [pair.prefill_blocks],
                               registration("decode-1", [1, 2, 3, 4, 5], "d-clean-1"))
    messages = [m for _, m in worker.sent]
    assert parse_push_digests(messages[0])[0] == "d-kvfault-1"
    assert messages[1] == b"d-kvfault-1:1"  # upstream's completion: "<decode request id>:<TP>"
    assert parse_push_digests(messages[2])[0] == "d-clean-1" and len(messages) == 3
    assert sender.take_counts() == (0, 1)


def test_digests_that_cannot_be_sent_never_cost_the_write():
    pair = Pair()
    worker = FakePushPrefill({"decode-1": "agent-d1"})

    def broken(agent, notif_msg):
        raise RuntimeError("NIXL send failed")

    worker.send_notif = broken
    prefill = BlockVerifier(pair.prefill, NUM_BLOCKS)
    sender = PushDigestSender(worker, lambda: prefill, lambda: None, KvFaults.none())
    assert sender.before_write("p-1", [pair.prefill_blocks], registration("decode-1", [1]))
    assert sender.take_counts() == (1, 0)  # counted as a WRITE without digests


def test_tp_workers_lease_verdicts_and_load_outcomes_both_reach_the_scheduler():
    """kv_both with verify_kv at TP 2: rank 0 has a lease verdict and no load this step, rank 1
    a load outcome and no verdict. vLLM's own aggregation (KVOutputAggregator: the first rank's
    meta's aggregate()) keeps both only when every rank returns the same type; a LeaseVerdicts
    beside a PdNixlWorkerMeta lost one. The connector's method runs on stand-ins for its tap and
    verifier (named as such: a worker-role connector needs a NIXL agent and KV caches)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from pd_plugins.connectors.vllm.pd_nixl import PdNixlPullConnector

    def rank(verdicts: LeaseVerdicts | None, outcomes: KvLoadOutcomes) -> ModelRunnerOutput:
        stand_in = SimpleNamespace(
            _experts=SimpleNamespace(after_step=lambda: None),
            _notif_tap=SimpleNamespace(take_verdicts=lambda: verdicts),
            _load_verifier=SimpleNamespace(take_outcomes=lambda: outcomes))
        meta = PdNixlPullConnector.build_connector_worker_meta(stand_in)
        return ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(
            kv_connector_worker_meta=meta))

    outputs = [rank(LeaseVerdicts([("p1", "agent", True, 0)]), KvLoadOutcomes()),
               rank(None, KvLoadOutcomes({"d1": LoadOutcome(3, 0, 0, True)}))]
    meta = KVOutputAggregator(2).aggregate(outputs).kv_connector_output.kv_connector_worker_meta
    assert meta.lease.verdicts == [("p1", "agent", True, 0)]
    assert meta.loads.outcomes == {"d1": LoadOutcome(3, 0, 0, True)}
