"""kv_transfer_params that are not a JSON object never reach upstream code that calls `.get` on
them (vLLM copies `vllm_xargs.kv_transfer_params` into the request unchecked): vLLM's real
scheduler with each of our connectors serves such requests locally and counts them."""

from __future__ import annotations

import pytest

from pd_plugins.connectors.vllm.counter_stats import REJECTED_PARAMS_KEY
from tests.unit.connectors.vllm_scheduler import make_request, make_scheduler

pytest.importorskip("vllm")

# What vLLM's API lets through vllm_xargs (strings, numbers, lists of them): the falsy ones
# pass vLLM's own `if params and params.get(...)` checks and reached NIXL's `.get`.
MALFORMED = ["", 0, 0.0, [], "x", 7, [1, "a"]]
PROMPT = list(range(1, 41))  # 40 tokens: two full blocks of 16 and a partial one


def prompt(i: int) -> list[int]:
    """A prompt of its own (no prefix-cache hits between the test's requests)."""
    return [100 + i] + PROMPT[1:]


def _rejected_count(scheduler) -> int:
    stats = scheduler.connector.get_kv_connector_stats()
    return sum(stats.data.get(REJECTED_PARAMS_KEY, ())) if stats is not None else 0


def _serves_malformed_params_locally(scheduler) -> None:
    requests = [make_request(f"bad-{i}", prompt(i), {"kv_transfer_params": value})
                for i, value in enumerate(MALFORMED)]
    for request in requests:
        scheduler.add_request(request)  # upstream NIXL raised AttributeError here
    output = scheduler.schedule()
    assert {r.request_id: output.num_scheduled_tokens.get(r.request_id) for r in requests} == {
        r.request_id: len(PROMPT) for r in requests}  # computed here, nothing loaded
    assert all(r.kv_transfer_params is None for r in requests)
    assert _rejected_count(scheduler) == len(MALFORMED)
    assert _rejected_count(scheduler) == 0  # counted once


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_pd_nixl_decode_serves_malformed_params_locally(mode):
    scheduler = make_scheduler("PdNixlConnector", "kv_consumer", {"mode": mode})
    try:
        _serves_malformed_params_locally(scheduler)
    finally:
        scheduler.shutdown()


def test_pd_nixl_prefill_serves_malformed_params_locally():
    scheduler = make_scheduler("PdNixlConnector", "kv_producer", {"lease_check_port": 0})
    try:
        _serves_malformed_params_locally(scheduler)
    finally:
        scheduler.shutdown()


def test_pd_nixl_well_formed_params_are_untouched():
    scheduler = make_scheduler("PdNixlConnector", "kv_consumer")
    try:
        request = make_request("ok", PROMPT, {"kv_transfer_params": {"do_remote_decode": False}})
        scheduler.add_request(request)
        scheduler.schedule()
        assert request.kv_transfer_params == {"do_remote_decode": False}
        assert _rejected_count(scheduler) == 0
    finally:
        scheduler.shutdown()


def test_pd_nixl_refuses_a_garbage_optional_field_before_upstream_reads_it():
    """A string where upstream does arithmetic (the lease expiry) would kill the worker: the
    load is reported failed instead (kv_load_failure_policy), never handed to NIXL."""
    scheduler = make_scheduler("PdNixlConnector", "kv_consumer")
    try:
        params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r",
                  "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
                  "remote_block_ids": [[0, 1]], "remote_blocks_expiry_time": "soon"}
        request = make_request("garbage-expiry", PROMPT, {"kv_transfer_params": params})
        scheduler.add_request(request)
        output = scheduler.schedule()
        assert request.kv_transfer_params["do_remote_prefill"] is False
        assert "remote_blocks_expiry_time" in request.kv_transfer_params["pd_rejected_reason"]
        assert not output.kv_connector_metadata.reqs_to_recv  # nothing handed to NIXL
        assert output.kv_connector_metadata.pd_rejected_recv == {"garbage-expiry"}
    finally:
        scheduler.shutdown()


# a decode request's params naming a remote prefill, as pd-router sends them
PULL_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r",
               "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
               "remote_block_ids": [[0, 1]]}


def schedule_loads(scheduler, changes: dict[str, dict]):
    """One request per id (each its own prompt) with PULL_PARAMS changed as given, all scheduled
    in one step: the requests, and the step's output."""
    requests = [make_request(req_id, prompt(i), {"kv_transfer_params": {**PULL_PARAMS, **change}})
                for i, (req_id, change) in enumerate(changes.items())]
    for request in requests:
        scheduler.add_request(request)
    return requests, scheduler.schedule()


def test_pd_nixl_refuses_a_prefill_whose_tp_size_does_not_divide_its_own():
    """Issue 29: a TP 2 decode cannot read a TP 3 prefill's heads (neither size divides the
    other): upstream would assert in its handshake thread and the request would hang. The load is
    reported failed with the reason instead, before upstream sees the params."""
    scheduler = make_scheduler("PdNixlConnector", "kv_consumer", tensor_parallel_size=2)
    try:
        (odd, even), output = schedule_loads(scheduler, {"tp3": {"tp_size": 3},
                                                         "tp4": {"tp_size": 4}})
        assert odd.kv_transfer_params["pd_rejected_reason"] == (
            "the prefill has TP 3 and this decode TP 2: one must divide the other for NIXL to "
            "map KV heads between their ranks")
        assert output.kv_connector_metadata.pd_rejected_recv == {"tp3"}
        assert "pd_rejected_reason" not in even.kv_transfer_params  # 4 over 2: upstream's job
    finally:
        scheduler.shutdown()


def test_pd_nixl_refuses_block_lists_that_do_not_match_its_cache_groups():
    """Issue 29: upstream reads one block list per KV cache group and asserts the count in the
    worker's read path; a request with another count is a failed load with the reason, never
    handed to NIXL. (A sliding-window model's two groups on a real engine:
    tests/e2e/test_attention_kinds.py.)"""
    scheduler = make_scheduler("PdNixlConnector", "kv_consumer")  # one KV cache group
    try:
        (two, flat), output = schedule_loads(scheduler, {
            "two": {"remote_block_ids": [[0, 1], [2, 3]]}, "flat": {"remote_block_ids": [0, 1]}})
        assert two.kv_transfer_params["pd_rejected_reason"] == (
            "kv_transfer_params.remote_block_ids has 2 block list(s), this decode's model has 1 "
            "KV cache group(s)")
        assert output.kv_connector_metadata.pd_rejected_recv == {"two"}
        assert "pd_rejected_reason" not in flat.kv_transfer_params  # one group: flat is fine
    finally:
        scheduler.shutdown()


def test_pd_shm_serves_malformed_params_locally(tmp_path):
    scheduler = make_scheduler("PdShmConnector", "kv_both",
                               {"pool_path": str(tmp_path / "pool"), "pool_size_gb": 0.01})
    try:
        _serves_malformed_params_locally(scheduler)
        # a dict whose slot list is not a list: ignored, not a crash of the scheduler
        request = make_request("bad-slots", prompt(99), {"kv_transfer_params": {
            "do_remote_prefill": True, "pool_slots": 5}})
        scheduler.add_request(request)
        assert scheduler.schedule().num_scheduled_tokens["bad-slots"] == len(PROMPT)
    finally:
        scheduler.shutdown()


def test_pd_lmcache_serves_malformed_params_locally():
    pytest.importorskip("lmcache")
    # `backend` has no default (transfer/options.py): this engine's own `cpu` pool, named
    scheduler = make_scheduler("PdLMCacheConnector", "kv_both", {"lookup": False, "backend": "cpu"},
                               engine_id="malformed-params-test")
    try:
        _serves_malformed_params_locally(scheduler)
    finally:
        scheduler.shutdown()


# -- a rejected load is reported only while vLLM parks the request for it ----------------------
# PdNixlConnector fails a load of unusable params by parking the request in WAITING_FOR_REMOTE_KVS
# and reporting it as a finished and failed receive; reported for a request in any other state,
# vLLM's scheduler asserts (scheduler.py's _update_from_kv_xfer_finished) and the engine dies.
UNUSABLE = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r",
            "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
            "remote_block_ids": [[0, 1]], "remote_blocks_expiry_time": "soon"}


def _report_rejected(scheduler, output) -> set[str]:
    """The workers' answer to the step (rejected ids: finished and failed receives), fed to
    vLLM's update_from_output, as the engine core does."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = set(output.kv_connector_metadata.pd_rejected_recv)
    req_ids = list(output.num_scheduled_tokens)
    scheduler.update_from_output(output, ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[] for _ in req_ids],
        kv_connector_output=KVConnectorOutput(finished_recving=ids, failed_recving=set(ids))))
    return ids


def test_unusable_params_on_a_request_that_skips_the_prefix_cache_are_not_reported():
    from vllm.sampling_params import SamplingParams

    scheduler = make_scheduler("PdNixlConnector", "kv_consumer")
    try:
        request = make_request("bad", PROMPT)
        request.sampling_params = SamplingParams(max_tokens=4, prompt_logprobs=1)
        request.skip_reading_prefix_cache = request.get_skip_reading_prefix_cache()
        request.kv_transfer_params = dict(UNUSABLE)
        scheduler.add_request(request)
        output = scheduler.schedule()
        assert output.num_scheduled_tokens.get("bad") == len(PROMPT)  # computed here
        assert _report_rejected(scheduler, output) == set()  # vLLM had asserted on this
    finally:
        scheduler.shutdown()


def test_unusable_params_retried_after_a_failed_allocation_are_still_failed_not_reported_running():
    from vllm.v1.request import RequestStatus

    scheduler = make_scheduler("PdNixlConnector", "kv_consumer")
    try:
        for i in range(3):  # most of the KV cache
            scheduler.add_request(make_request(f"f{i}", [500 + i] + list(range(1, 1000)),
                                               max_tokens=20))
        _report_rejected(scheduler, scheduler.schedule())
        request = make_request("bad", [9] + list(range(1, 300)),
                               {"kv_transfer_params": dict(UNUSABLE)})
        scheduler.add_request(request)
        _report_rejected(scheduler, scheduler.schedule())  # no room: it waits
        assert request.status == RequestStatus.WAITING
        scheduler.finish_requests(["f0", "f1"], RequestStatus.FINISHED_ABORTED)
        output = scheduler.schedule()
        assert set(output.kv_connector_metadata.pd_rejected_recv) == {"bad"}
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # parked to be failed
        _report_rejected(scheduler, output)  # vLLM had asserted on this
    finally:
        scheduler.shutdown()


def test_pd_nixl_gives_upstream_a_lease_written_as_a_string_as_a_number():
    """Upstream reads `kv_lease_duration` raw (`lease // 6`): "12" stopped the engine at startup
    with a TypeError naming no key."""
    scheduler = make_scheduler("PdNixlConnector", "kv_producer",
                               {"kv_lease_duration": "12", "lease_check_port": 0})
    try:
        upstream = scheduler.connector.connector_scheduler
        assert (upstream._kv_lease_duration, upstream._heartbeat_interval) == (12, 2)
    finally:
        scheduler.shutdown()


# -- block lists upstream's read path cannot take ----------------------------------------------
def test_pd_nixl_refuses_block_ids_past_int32():
    """Upstream computes descriptor ids as int32: a larger id raised OverflowError in the decode
    worker's start_load_kv, on the engine's main thread."""
    scheduler = make_scheduler("PdNixlConnector", "kv_consumer")
    try:
        (huge,), output = schedule_loads(scheduler, {
            "huge": {"remote_block_ids": [[2**31, 2**31 + 1, 2**31 + 2]]}})
        assert "remote_block_ids must be" in huge.kv_transfer_params["pd_rejected_reason"]
        assert output.kv_connector_metadata.pd_rejected_recv == {"huge"}
        assert not output.kv_connector_metadata.reqs_to_recv
    finally:
        scheduler.shutdown()


def test_pd_nixl_refuses_block_lists_shorter_than_what_the_decode_reads():
    """A 40-token prompt takes 3 blocks of 16: upstream's worker asserts that the prefill lists at
    least as many as the decode reads into (base_worker._apply_prefix_caching), and its scheduler
    that an empty list comes with nothing to load. Checked once the prefill states this decode's
    block size (its `pd` section); the load fails with the reason instead."""
    from tests.unit.connectors.vllm_scheduler import BLOCK_SIZE

    section = {"prompt_tokens": 40, "cached_tokens": 0, "engine_id": "p", "mode": "pull",
               "block_size": BLOCK_SIZE}
    scheduler = make_scheduler("PdNixlConnector", "kv_consumer")
    try:
        requests, output = schedule_loads(scheduler, {
            "one": {"remote_block_ids": [[0]], "pd": section},
            "none": {"remote_block_ids": [[]], "pd": section},
            "empty": {"remote_block_ids": [], "pd": section},  # upstream's scheduler asserted
            "enough": {"remote_block_ids": [[0, 1, 2]], "pd": section},
            "stated": {"remote_block_ids": [[0]], "remote_block_size": BLOCK_SIZE},
            # a DCP 2 prefill's blocks cover 2 x block_size tokens: 2 of them hold 40 tokens,
            # and upstream's pull worker pairs that layout with a DCP 1 decode
            "dcp": {"remote_block_ids": [[0, 1]], "dcp_size": 2, "tp_size": 2, "pd": section},
            "dcp1": {"remote_block_ids": [[0]], "dcp_size": 1, "pd": section}})
        reasons = {r.request_id: r.kv_transfer_params.get("pd_rejected_reason") for r in requests}
        assert reasons["one"] == ("kv_transfer_params.remote_block_ids lists 1 block(s) for KV "
                                  "cache group 0, this decode reads 3 there")
        assert "lists 0 block(s)" in reasons["none"] and "lists 1 block(s)" in reasons["stated"]
        assert "is empty" in reasons["empty"]
        assert "lists 1 block(s)" in reasons["dcp1"]
        assert reasons["enough"] is None and reasons["dcp"] is None
        meta = output.kv_connector_metadata
        assert meta.pd_rejected_recv == {"one", "none", "empty", "stated", "dcp1"}
        assert set(meta.reqs_to_recv) == {"enough", "dcp"}  # nothing else handed to NIXL
        _report_rejected(scheduler, output)  # the workers fail them; vLLM takes that
        started = ("enough", "dcp")
        assert all(r.is_finished() for r in requests if r.request_id not in started)  # policy fail
    finally:
        scheduler.shutdown()
