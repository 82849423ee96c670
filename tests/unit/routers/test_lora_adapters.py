"""LoRA adapters in the router: a request for an adapter goes only to workers that serve it, and
its prefix keys are its own (the same prompt under two adapters, or an adapter and the base
model, never scores as a shared prefix), from the request, from KV events and from a pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest

from pd_plugins.routers.policy import preset
from pd_plugins.routers.policy.base import build
from pd_plugins.routers.policy.scheduler import Scheduler
from pd_plugins.routers.request import parse_request
from pd_plugins.vocab.block_keys import ROOT_KEY, adapter_root, block_keys, text_block_keys
from tests.unit.routers.helpers import BLOCK, context

PROMPT = list(range(100, 132))  # 8 blocks of 4
ADAPTERS = {"lora-a": "tiny", "lora-b": "tiny"}


@dataclass
class Target:
    """A model group as parse_request sees it (request.ModelTarget)."""

    max_model_len: int | None = 512
    key_block_size: int | None = BLOCK
    tokenize: object = None
    adapter_parents: dict[str, str] = field(default_factory=lambda: dict(ADAPTERS))


def parse(model: str, prompt=PROMPT):
    body = msgspec.json.encode({"model": model, "prompt": prompt, "max_tokens": 4})
    return parse_request(body, "completion", {}, strip_transfer_fields=False,
                         select_model=lambda name: Target()).info


def test_adapter_roots_differ_from_the_base_and_from_each_other():
    roots = {adapter_root(None), adapter_root("lora-a"), adapter_root("lora-b")}
    assert len(roots) == 3 and adapter_root(None) == ROOT_KEY == adapter_root("")
    assert adapter_root("lora-a") == adapter_root("lora-a")  # no per-process string hash


def test_a_request_for_an_adapter_has_its_own_block_keys():
    base, a, b = parse("tiny"), parse("lora-a"), parse("lora-b")
    assert (base.adapter, a.adapter, b.adapter) == (None, "lora-a", "lora-b")
    assert base.block_keys == block_keys(PROMPT, BLOCK)
    assert a.block_keys == block_keys(PROMPT, BLOCK, adapter_root("lora-a"))
    # not one key in common, so no prefix of any length is shared
    assert not set(base.block_keys) & set(a.block_keys)
    assert not set(a.block_keys) & set(b.block_keys)
    text = parse("lora-a", prompt="x" * 80)
    assert text.block_keys == text_block_keys("x" * 80, BLOCK, 4, adapter_root("lora-a"))


def test_prefix_scorer_sees_no_shared_prefix_across_adapters():
    ctx = context()
    a, b = ctx.pool.by_role("decode")
    ctx.prefix_index.record_routed(a.url, parse("lora-a").block_keys)
    scorer = build("scorer", "prefix_cache", {}, ctx)
    assert scorer.score(parse("lora-a"), [a, b]) == [1.0, 0.0]
    assert scorer.score(parse("lora-b"), [a, b]) == [0.0, 0.0]
    assert scorer.score(parse("tiny"), [a, b]) == [0.0, 0.0]


def serve(worker, *adapters):
    worker.models = ("tiny", *adapters)
    worker.adapter_parents = {name: "tiny" for name in adapters}


def test_an_adapter_request_goes_only_to_workers_that_serve_it():
    ctx = context()
    (p1, p2), (d1, d2) = ctx.pool.by_role("prefill"), ctx.pool.by_role("decode")
    serve(p1), serve(p2, "lora-a"), serve(d1, "lora-a", "lora-b"), serve(d2)
    scheduler = Scheduler(preset("round_robin"), ctx)
    for _ in range(4):  # round robin would alternate; the adapter pins both legs
        decision = scheduler.schedule(parse("lora-a"))
        assert (decision.decode, decision.prefill) == (d1, p2)
    # lora-b: no prefill has it, so the decode that has it prefills locally
    decision = scheduler.schedule(parse("lora-b"))
    assert decision.decode is d1 and decision.prefill is None
    assert "no prefill worker serves adapter 'lora-b'" in decision.reasons[-1]
    # the base model goes anywhere, as before
    assert {scheduler.schedule(parse("tiny")).decode for _ in range(2)} == {d1, d2}


def test_no_usable_decode_with_the_adapter_means_no_decision():
    ctx = context()
    (p1, p2), (d1, d2) = ctx.pool.by_role("prefill"), ctx.pool.by_role("decode")
    serve(p1, "lora-a"), serve(p2), serve(d1, "lora-a"), serve(d2)
    scheduler = Scheduler(preset("default"), ctx)
    assert scheduler.schedule(parse("lora-a")).decode is d1
    d1.healthy = False  # the only decode with the adapter is down: the proxy answers 503
    assert scheduler.schedule(parse("lora-a")) is None
    assert scheduler.schedule(parse("tiny")).decode is d2


kv_events = pytest.importorskip("vllm.distributed.kv_events")


def stored(hashes, parent, tokens, lora_name):
    event = kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                  block_size=BLOCK, lora_id=None, medium="GPU", lora_name=lora_name)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(event))


def test_kv_events_of_an_adapters_blocks_key_them_under_the_adapter():
    from pd_plugins.routers.kv_sources.events import EventApplier, EventRejected
    from pd_plugins.routers.policy.prefix_index import PrefixIndex

    index = PrefixIndex()
    events = EventApplier(index, "http://w")
    events.apply(stored([1, 2], None, PROMPT[:8], "lora-a"))
    events.apply(stored([3], 2, PROMPT[8:12], "lora-a"))  # chained: inherits the adapter's root
    assert index.matched_blocks("http://w", parse("lora-a").block_keys) == 3
    assert index.matched_blocks("http://w", parse("lora-b").block_keys) == 0
    assert index.matched_blocks("http://w", parse("tiny").block_keys) == 0
    with pytest.raises(EventRejected, match="lora_name"):
        events.apply({**stored([4], None, PROMPT[:4], None), "lora_name": 7})


def test_router_maps_an_adapter_to_its_models_group_and_keeps_it_while_its_workers_are_down():
    """In-process Router with two models: an adapter's requests reach its base model's group with
    the adapter's own keys; with its workers down it is still known (the proxy answers 503, as the
    scheduler finds no worker), while a name nobody lists is a 404."""
    from pd_plugins.routers.config import config_from_mapping
    from pd_plugins.routers.request import BadRequest
    from pd_plugins.routers.server import Router

    from pd_plugins.routers.policy.scheduler import PRESETS

    router = Router(config_from_mapping({"block_size": BLOCK, "policy": PRESETS["prefix_cache"], "models": [
        {"name": "tiny", "prefill": [{"url": "http://127.0.0.1:8101"}],
         "decode": [{"url": "http://127.0.0.1:8201"}]},
        {"name": "other", "decode": [{"url": "http://127.0.0.1:8202"}]}]}))
    group = router.groups["tiny"]
    for worker in group.pool:
        serve(worker, "lora-a")
        worker.healthy = True
    router.refresh_served()

    def info(model):
        body = msgspec.json.encode({"model": model, "prompt": PROMPT, "max_tokens": 4})
        return parse_request(body, "completion", {}, strip_transfer_fields=False,
                             select_model=router.select_model)

    request = info("lora-a")
    assert request.target is group and request.info.adapter == "lora-a"
    assert request.info.block_keys == block_keys(PROMPT, BLOCK, adapter_root("lora-a"))
    assert group.scheduler.schedule(request.info) is not None
    for worker in group.pool:
        worker.healthy = False
    router.refresh_served()
    request = info("lora-a")
    assert request.target is group and group.scheduler.schedule(request.info) is None
    with pytest.raises(BadRequest) as unknown:
        info("lora-z")
    assert unknown.value.status == 404 and "lora-a" in unknown.value.message
