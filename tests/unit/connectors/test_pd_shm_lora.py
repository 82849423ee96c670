"""PdShmConnector under LoRA adapters, in vLLM's real scheduler on CPU: blocks are found by the
engine's block hash, which covers the adapter, so a prompt an adapter stored is no pool hit for
another adapter or the base model; the router-facing key stored beside each block is salted with
the adapter's name as the router salts a request's keys (vocab/block_keys.adapter_root)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from pd_plugins.vocab.block_keys import adapter_root, block_keys
from pd_plugins.vocab.transfer_params import prefill_flags
from tests.unit.connectors.vllm_scheduler import BLOCK_SIZE, make_request, make_scheduler

pytest.importorskip("vllm")

PROMPT = list(range(1, 41))  # two full blocks of 16 and 8 tokens


def lora(name: str):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=1 if name == "a" else 2,
                       lora_path=f"/adapters/{name}")


@pytest.fixture
def schedulers(tmp_path):
    made = []

    def scheduler(role: str):
        made.append(make_scheduler("PdShmConnector", role, {
            "pool_path": str(tmp_path / "pool"), "pool_size_gb": 0.01, "remove_when_unused": True},
            engine_id=f"shm-{uuid.uuid4().hex[:8]}"))
        return made[-1]

    yield scheduler
    for s in made:
        s.shutdown()


def test_an_adapters_blocks_are_keyed_and_found_under_that_adapter_only(schedulers):
    from pd_plugins.connectors.vllm.pd_shm import pool_key

    prefill = schedulers("kv_producer")
    leg = make_request("leg-a", PROMPT, {"kv_transfer_params": prefill_flags()}, max_tokens=1,
                       lora_request=lora("a"))
    prefill.add_request(leg)
    (store,) = prefill.schedule().kv_connector_metadata.stores
    assert store.content_keys == block_keys(PROMPT, BLOCK_SIZE, adapter_root("a"))
    # publish the two blocks as the prefill's worker side would
    pool = prefill.connector.pool
    refs = pool.reserve([pool_key(h, 0) for h in store.block_hashes], store.content_keys)
    row = np.zeros(pool.slot_bytes, np.uint8)
    assert all(pool.publish([(r, pool.write(r, row), pool.slot_bytes) for r in refs], hold_s=60))

    decode = schedulers("kv_consumer")
    found = {}
    for name, kwargs in {"a": {"lora_request": lora("a")}, "b": {"lora_request": lora("b")},
                         "base": {}}.items():
        request = make_request(f"d-{name}", PROMPT, **kwargs)
        found[name] = decode.connector.get_num_new_matched_tokens(request, 0)[0]
    assert found == {"a": 2 * BLOCK_SIZE, "b": 0, "base": 0}
