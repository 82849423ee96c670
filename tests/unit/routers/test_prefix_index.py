"""The prefix index: chained block keys, approximate mode and its bound (the exact mode, fed by
vLLM's KV events, is tested in test_kv_events.py)."""

from pd_plugins.routers.policy.prefix_index import PrefixIndex
from pd_plugins.vocab.block_keys import block_keys

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
