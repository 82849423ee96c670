import json
import random

import pytest

from pd_plugins.routers.flows.sglang import bootstrap_room
from pd_plugins.routers.health import parse_engine_metrics
from pd_plugins.routers.upstream import WorkerFailed, answer_params

VLLM_METRICS = """# HELP vllm:num_requests_waiting Number of requests waiting.
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 2.0
vllm:num_requests_running{engine="0",model_name="tiny"} 4.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
"""


def test_engine_metrics_are_summed_over_ranks_and_prefix_names_ignored():
    assert parse_engine_metrics(VLLM_METRICS, "vllm") == (5.0, 4.0, 0.25)
    assert parse_engine_metrics("sglang:num_queue_reqs 7\nsglang:token_usage 0.5\n", "sglang") == (7.0, 0.0, 0.5)


def test_bootstrap_rooms_keep_a_conversation_on_one_dp_rank():
    rng = random.Random(0)
    ranks = {bootstrap_room(4, "conversation-a", rng) % 4 for _ in range(50)}
    assert len(ranks) == 1
    rooms = [bootstrap_room(4, None, rng) for _ in range(50)]
    assert len({r % 4 for r in rooms}) > 1 and all(0 <= r < 2**63 for r in rooms)
    assert len(set(rooms)) == 50


def test_an_admin_token_that_is_not_utf8_is_refused_not_a_500():
    # aiohttp passes a non-UTF-8 header on with surrogates; /ready asks allows() for every probe
    from types import SimpleNamespace

    from pd_plugins.routers.admin import AdminApi

    admin = AdminApi(None, "the-token")
    odd = SimpleNamespace(headers={"Authorization": b"Bearer \xff\xfe".decode("utf-8", "surrogateescape")})
    assert admin.allows(odd) is False
    assert admin.allows(SimpleNamespace(headers={"Authorization": "Bearer the-token"})) is True


def test_a_leg_answer_gives_its_kv_transfer_params_and_a_malformed_one_is_the_workers_fault():
    worker = type("W", (), {"url": "http://p0"})()
    params = {"remote_engine_id": "p0", "remote_block_ids": [[1, 2]], "pd": {"cached_tokens": 3}}
    answer = json.dumps({"id": "x", "choices": [{"text": "a", "logprobs": None}],
                         "usage": {"prompt_tokens": 9}, "kv_transfer_params": params}).encode()
    assert answer_params(answer, worker, "prefill") == params
    assert answer_params(b'{"choices": []}', worker, "prefill") is None
    for payload, why in ((b"[1, 2]", "not a JSON object"), (b"not json", "not JSON"),
                         (b'{"kv_transfer_params": 1', "not JSON")):
        with pytest.raises(WorkerFailed, match=why):
            answer_params(payload, worker, "prefill")
