"""PdLMCacheConnector keys chunks by everything vLLM's block hashes include: requests that differ
in cache_salt or LoRA adapter never share pool entries; requests that agree do.

vLLM's real scheduler drives the connector's scheduler side; its worker side (in this process,
with a small KV tensor) stores into and answers lookups from a real LMCache engine on a shared
directory, over the real lookup channel."""

from __future__ import annotations

import uuid

import pytest
import torch

from tests.unit.connectors.vllm_scheduler import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    make_request,
    make_scheduler,
)

pytest.importorskip("lmcache")

PROMPT = list(range(1, 70))  # 4 full blocks of 16, and 5 tokens more


def lora(name: str):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=abs(hash(name)) % 1000 + 1,
                       lora_path=f"/adapters/{name}")


def test_pool_namespace_follows_vllm_block_hash_inputs():
    from pd_plugins.connectors.vllm.pd_lmcache import (
        lookup_message,
        pool_namespace,
        split_lookup_message,
    )

    def ns(**kw):
        return pool_namespace(make_request(f"r-{uuid.uuid4().hex}", PROMPT, **kw))

    assert ns() == ""
    assert ns(cache_salt="alice") == ns(cache_salt="alice") != ns(cache_salt="bob") != ""
    assert ns(lora_request=lora("a")) == ns(lora_request=lora("a")) != ns(lora_request=lora("b"))
    assert ns(lora_request=lora("a"), cache_salt="alice") not in (
        ns(lora_request=lora("a")), ns(cache_salt="alice"))
    salted = ns(cache_salt="alice")
    assert split_lookup_message(lookup_message(PROMPT, salted)) == (PROMPT, salted)
    assert split_lookup_message(lookup_message(PROMPT, "")) == (PROMPT, "")


@pytest.fixture
def lmcache_engine(tmp_path):
    """A scheduler and a worker side of one PdLMCacheConnector engine on a shared directory."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pd_plugins.connectors.vllm.pd_lmcache import PdLMCacheConnector

    engine_id = f"ns-test-{uuid.uuid4().hex[:8]}"
    scheduler = make_scheduler("PdLMCacheConnector", "kv_both",
                               {"backend": f"fs://{tmp_path}", "store": "all"},
                               engine_id=engine_id)
    kv_cache_config = scheduler.kv_cache_config
    worker = PdLMCacheConnector(scheduler.vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    layer = kv_cache_config.kv_cache_groups[0].layer_names[0]
    gen = torch.Generator().manual_seed(0)
    worker.register_kv_caches({layer: torch.rand(NUM_BLOCKS, 2, BLOCK_SIZE, 1, 1, generator=gen)})
    try:
        yield scheduler, worker
    finally:
        worker.shutdown()
        scheduler.shutdown()


def _run_step(scheduler, worker):
    output = scheduler.schedule()
    worker.bind_connector_metadata(output.kv_connector_metadata)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return output


def test_salted_and_lora_requests_share_pool_entries_only_with_their_own_kind(lmcache_engine):
    scheduler, worker = lmcache_engine
    kinds = {"plain": {}, "alice": {"cache_salt": "alice"}, "bob": {"cache_salt": "bob"},
             "lora-a": {"lora_request": lora("a")}, "lora-b": {"lora_request": lora("b")}}
    # Store the prompt once as salted "alice" (store: all), then finish that request.
    first = make_request("store-alice", PROMPT, **kinds["alice"])
    scheduler.add_request(first)
    stored = _run_step(scheduler, worker)
    assert [op.namespace for op in stored.kv_connector_metadata.stores] != [""]
    scheduler.finish_requests("store-alice", first.status.FINISHED_ABORTED)
    # Another engine's view: the same prompt as every kind. Only "alice" finds it in the pool.
    found = {}
    for name, kw in kinds.items():
        request = make_request(f"probe-{name}", PROMPT, **kw)
        hit, _ = scheduler.connector.get_num_new_matched_tokens(request, 0)
        found[name] = hit
        scheduler.connector.request_finished(request, [])
    assert found == {"plain": 0, "alice": 64, "bob": 0, "lora-a": 0, "lora-b": 0}
    # And a LoRA request's chunks are found by the same adapter only.
    lora_a = make_request("store-lora-a", [500 + t for t in PROMPT], **kinds["lora-a"])
    scheduler.add_request(lora_a)
    _run_step(scheduler, worker)
    scheduler.finish_requests("store-lora-a", lora_a.status.FINISHED_ABORTED)
    for name, expected in [("lora-a", 64), ("lora-b", 0), ("plain", 0)]:
        request = make_request(f"probe2-{name}", [500 + t for t in PROMPT], **kinds[name])
        assert scheduler.connector.get_num_new_matched_tokens(request, 0)[0] == expected, name
        scheduler.connector.request_finished(request, [])
