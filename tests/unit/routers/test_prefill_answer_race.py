"""A client that leaves just as its prefill answers (vLLM pull flow): the proxy releases the KV that
answer holds through a one-token decode leg, and the cancellation goes on; no retry is made for a
client that left. In-process: the prefill leg's HTTP is replaced by the race itself (the leg's
client hands over an answer whose reader was cancelled, see test_http_client.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pd_plugins.routers import proxy as proxy_module
from pd_plugins.routers.cli import build_parser, config_from_args
from pd_plugins.routers.flows import Attempt
from pd_plugins.routers.request import parse_request
from pd_plugins.routers.server import Router
from pd_plugins.routers.upstream import Pools

P1, D1 = "http://127.0.0.1:8101", "http://127.0.0.1:8201"
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [1, 2],
          "remote_host": "127.0.0.1", "remote_port": 5600}


async def _prepare_with_race(monkeypatch, answer: bytes) -> list:
    router = Router(config_from_args(build_parser().parse_args(
        ["--prefill", P1, "--decode", D1, "--policy", "round_robin"])))
    group = router._only_group()
    await group.start(router.metrics, Pools(1.0), {}, None)
    proxy = group.proxy
    released = []
    monkeypatch.setattr(proxy, "release_later", lambda attempt, body: released.append(
        json.loads(body) if isinstance(body, bytes) else body))  # (bytes: ClientRequest.body_with)
    legs = []

    async def raced_leg(pools, worker, leg, path, body, request_id, timeout_s, on_orphan=None):
        legs.append(leg)
        on_orphan(200, answer)  # the whole answer is in ...
        raise asyncio.CancelledError  # ... and the client left before the leg's task resumed

    monkeypatch.setattr(proxy_module, "whole_leg", raced_leg)
    request = parse_request(b'{"model": "m", "prompt": "hello there", "max_tokens": 4}',
                            "completion", {}, select_model=router.select_model,
                            strip_transfer_fields=False)
    for worker in group.pool:
        worker.healthy = True
    decision = proxy.scheduler.schedule(request.info)
    assert decision is not None and decision.prefill is not None
    attempt = Attempt(request, decision, "rid-0", "/v1/completions")
    with pytest.raises(asyncio.CancelledError):
        await proxy._prepare(attempt)
    assert attempt.client_left and legs == ["prefill"]
    return released


def test_an_answer_that_arrives_as_the_client_leaves_is_released(monkeypatch):
    answer = json.dumps({"choices": [], "kv_transfer_params": PARAMS}).encode()
    released = asyncio.run(_prepare_with_race(monkeypatch, answer))
    assert len(released) == 1
    assert released[0]["kv_transfer_params"] == PARAMS and released[0]["prompt"] == "hello there"


def test_an_unusable_answer_as_the_client_leaves_is_a_cancellation_not_a_retry(monkeypatch):
    # no kv_transfer_params: WorkerFailed for a client still there (retried elsewhere); for one
    # that left, nothing to release and nothing to retry
    assert asyncio.run(_prepare_with_race(monkeypatch, b'{"choices": []}')) == []
    assert asyncio.run(_prepare_with_race(monkeypatch, b"not json")) == []
