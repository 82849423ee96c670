"""The prefix index, fed by vLLM's own KV event structs over a real ZMQ socket."""

import asyncio
import time

import msgspec
import pytest
import zmq

from pd_plugins.routers.policy.prefix_index import KvEventSubscriber, PrefixIndex, block_keys
from pd_plugins.testing.processes import free_port

kv_events = pytest.importorskip("vllm.distributed.kv_events")
W = "http://w"


def test_block_keys_chain_and_ignore_partial_block():
    keys = block_keys(list(range(10)), 4)
    assert len(keys) == 2
    assert block_keys([9] + list(range(1, 10)), 4)[1] != keys[1]  # same block, other history


def test_approximate_mode_evicts_oldest():
    index = PrefixIndex(capacity_blocks=4)
    first, second = block_keys(list(range(16)), 4), block_keys(list(range(100, 116)), 4)
    index.record_routed(W, first)
    assert index.matched_blocks(W, first) == 4
    index.record_routed(W, second)
    assert index.matched_blocks(W, first) == 0 and index.matched_blocks(W, second) == 4


def stored(hashes, parent, tokens, size=4):
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                 block_size=size, lora_id=None, medium="GPU", lora_name=None)


def as_wire(event) -> dict:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(event))


def test_events_map_engine_hashes_onto_router_keys():
    index = PrefixIndex()
    tokens = list(range(12))
    index.apply_event(W, as_wire(stored([11, 12], None, tokens[:8])))
    index.apply_event(W, as_wire(stored([13], 12, tokens[8:12])))  # chained on engine hash 12
    keys = block_keys(tokens, 4)
    assert index.matched_blocks(W, keys) == 3
    index.apply_event(W, as_wire(kv_events.BlockRemoved(block_hashes=[12], medium="GPU")))
    assert index.matched_blocks(W, keys) == 1
    index.apply_event(W, as_wire(kv_events.AllBlocksCleared()))
    assert index.matched_blocks(W, keys) == 0


def test_subscriber_reads_vllm_wire_format_over_zmq():
    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    index = PrefixIndex()
    tokens = list(range(40, 56))
    encoder = msgspec.msgpack.Encoder()

    async def scenario() -> int:
        sub = KvEventSubscriber(index, W, f"tcp://127.0.0.1:{port}")
        task = asyncio.create_task(sub.run())
        deadline = time.monotonic() + 10
        seq = 0
        while index.matched_blocks(W, block_keys(tokens, 4)) < 4 and time.monotonic() < deadline:
            batch = kv_events.KVEventBatch(ts=time.time(), events=[stored([1, 2, 3, 4], None, tokens)])
            pub.send_multipart((b"", seq.to_bytes(8, "big"), encoder.encode(batch)))
            seq += 1
            await asyncio.sleep(0.05)  # a SUB misses what is sent before it has connected
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return sub.events_applied

    try:
        applied = asyncio.run(scenario())
    finally:
        pub.close(linger=0)
    assert applied >= 1
    assert index.matched_blocks(W, block_keys(tokens, 4)) == 4
