"""block_verifier.py: ws64 digests of whole blocks of every layer of a paged KV cache, the read
pairing of upstream NIXL (end-trimmed prefill list) and the fault hook's damage."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pd_plugins.connectors.vllm.block_verifier import BlockVerifier, first_mismatch, paired_expected
from pd_plugins.transfer.kv_digest import reference_digest

NUM_BLOCKS = 12


def cpu_layers(seed: int, layers: int = 3) -> list[torch.Tensor]:
    """vLLM CPU's layout: [num_blocks, heads, block_size, 2 * head_size] per layer."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, 2, 4, 8, generator=gen) for _ in range(layers)]


def block_bytes(layers: list[torch.Tensor], block: int, dim: int = 0) -> bytes:
    return b"".join(t.movedim(dim, 0)[block].contiguous().numpy().tobytes() for t in layers)


def test_digests_are_ws64_of_a_blocks_layers_in_order():
    layers = cpu_layers(1)
    verifier = BlockVerifier(layers, NUM_BLOCKS)
    ids = [7, 0, 11, 3]
    assert verifier.digests(ids).tolist() == [reference_digest(block_bytes(layers, b))
                                              for b in ids]
    assert verifier.block_bytes == len(block_bytes(layers, 0))


def test_a_split_k_v_layout_goes_through_the_torch_formula_with_the_same_digests():
    # [2, num_blocks, ...] (flash-attention's layout): a block is not one host row
    gen = torch.Generator().manual_seed(2)
    split = [torch.randn(2, NUM_BLOCKS, 4, 8, generator=gen) for _ in range(2)]
    verifier = BlockVerifier(split, NUM_BLOCKS)
    assert verifier._rows is None
    ids = [5, 1]
    assert verifier.digests(ids).tolist() == [reference_digest(block_bytes(split, b, dim=1))
                                              for b in ids]


@pytest.mark.parametrize("split", [False, True])
def test_damage_changes_one_byte_of_one_block(split):
    layers = ([torch.randn(2, NUM_BLOCKS, 4, 8) for _ in range(2)] if split
              else cpu_layers(3, layers=2))
    verifier = BlockVerifier(layers, NUM_BLOCKS)
    before = verifier.digests(range(NUM_BLOCKS))
    raw_before = block_bytes(layers, 4, dim=1 if split else 0)
    byte = verifier.block_bytes - 3  # in the last layer
    verifier.damage(4, byte)
    after = verifier.digests(range(NUM_BLOCKS))
    assert np.flatnonzero(before != after).tolist() == [4]
    raw_after = block_bytes(layers, 4, dim=1 if split else 0)
    diff = [i for i, (x, y) in enumerate(zip(raw_before, raw_after)) if x != y]
    assert diff == [byte] and raw_after[byte] == raw_before[byte] ^ 0xFF
    with pytest.raises(ValueError):
        verifier.damage(4, verifier.block_bytes)


def test_digests_refuse_block_ids_outside_the_cache():
    verifier = BlockVerifier(cpu_layers(4), NUM_BLOCKS)
    with pytest.raises(ValueError):
        verifier.digests([NUM_BLOCKS])
    assert verifier.digests([]).size == 0


def test_a_decode_with_a_local_prefix_hit_pairs_with_the_tail_of_the_prefills_list():
    expected = np.arange(10, 15, dtype=np.uint64)  # the prefill's 5 blocks
    assert paired_expected(expected, 5, 5).tolist() == [10, 11, 12, 13, 14]
    assert paired_expected(expected, 5, 2).tolist() == [13, 14]  # 3 blocks hit locally
    assert paired_expected(expected, 6, 2) is None  # digests of other blocks than were sent
    assert paired_expected(expected, 5, 6) is None  # more local blocks than remote ones
    assert paired_expected(expected, 5, 0) is None


def test_first_mismatch():
    found = np.array([1, 2, 3, 4], dtype=np.uint64)
    assert first_mismatch(found, found.copy()) is None
    assert first_mismatch(found, np.array([1, 2, 9, 9], dtype=np.uint64)) == 2


def test_what_digesting_cost_is_taken_once_and_lands_on_the_shared_counters():
    from pd_plugins.connectors.vllm.counter_stats import CounterStats
    from pd_plugins.connectors.vllm.kv_verdicts import KV_VERIFY_COUNTERS, count_digest_cost

    class Stats(CounterStats):
        COUNTERS = KV_VERIFY_COUNTERS

    verifier = BlockVerifier(cpu_layers(3), NUM_BLOCKS)
    verifier.digests([1, 2, 3])
    verifier.digests([4])
    stats = Stats()
    count_digest_cost(stats, verifier)
    count_digest_cost(stats, None)  # a transport without a verifier counts nothing
    reduced = stats.reduce()
    assert reduced["pd_kv_digested_bytes"] == 4 * verifier.block_bytes
    assert reduced["pd_kv_digest_seconds"] > 0
    assert verifier.take_cost() == (0.0, 0)  # taken: the next step starts from zero
