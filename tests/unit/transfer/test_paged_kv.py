"""Block copies between paged KV tensors and pool rows, for both known layouts."""

import numpy as np
import pytest
import torch

from pd_plugins.transfer.paged_kv import PagedKV, block_dim
from pd_plugins.transfer.shm_pool import checksum, copy_runs

NUM_BLOCKS = 10


def layers(layout: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if layout == "cpu":  # vLLM CPU: [num_blocks, heads, block_size, 2 * head_size]
        return [torch.randn(NUM_BLOCKS, 2, 4, 16, generator=g) for _ in range(3)]
    return [torch.randn(2, NUM_BLOCKS, 4, 2, 8, generator=g) for _ in range(3)]  # [2, blocks, ...]


def test_copy_runs_moves_rows_and_sums_them():
    src = np.random.default_rng(0).integers(0, 255, (12, 64), dtype=np.uint8)
    dst = np.zeros((12, 80), dtype=np.uint8)  # wider rows, like pool slots
    src_rows, dst_rows = [3, 4, 5, 9, 10], [0, 1, 7, 8, 9]  # runs break where either side jumps
    sums = copy_runs(src, src_rows, dst, dst_rows, sum_source=True)
    for s, d, total in zip(src_rows, dst_rows, sums):
        assert np.array_equal(dst[d, :64], src[s]) and int(total) == checksum(src[s])
    assert not dst[:, 64:].any() and not dst[[2, 3, 4, 5, 6, 10, 11]].any()
    back = np.zeros((12, 64), dtype=np.uint8)
    assert list(copy_runs(dst, dst_rows, back, src_rows, sum_source=False)) == list(sums)
    assert len(copy_runs(src, [], dst, [], sum_source=True)) == 0


def test_copy_runs_without_checksums_copies_the_same_and_sums_nothing():
    src = np.random.default_rng(1).integers(0, 255, (6, 64), dtype=np.uint8)
    dst = np.zeros((6, 80), dtype=np.uint8)
    assert not copy_runs(src, [5, 0, 1], dst, [0, 2, 3], sum_source=None).any()  # zeros
    assert np.array_equal(dst[[0, 2, 3], :64], src[[5, 0, 1]]) and not dst[[1, 4, 5]].any()
    assert not dst[:, 64:].any()
    odd_src, odd_dst = src[:, :13], np.zeros((6, 13), dtype=np.uint8)  # not whole 8-byte words
    assert not copy_runs(odd_src, [2, 3], odd_dst, [4, 0], sum_source=None).any()
    assert np.array_equal(odd_dst[[4, 0]], odd_src[[2, 3]])
    wider = np.zeros((6, 80), dtype=np.uint8)  # odd rows into pool-wide slots: the rows' width
    copy_runs(odd_src, [1], wider, [2], sum_source=None)
    assert np.array_equal(wider[2, :13], odd_src[1]) and not wider[2, 13:].any()
    with pytest.raises(ValueError, match="8-byte words"):
        copy_runs(odd_src, [2], odd_dst, [4], sum_source=True)


def test_block_dim_is_found_or_refused():
    assert block_dim(torch.zeros(NUM_BLOCKS, 3), NUM_BLOCKS) == 0
    assert block_dim(torch.zeros(2, NUM_BLOCKS, 3), NUM_BLOCKS) == 1
    with pytest.raises(ValueError, match="no block dimension"):
        block_dim(torch.zeros(3, 3), NUM_BLOCKS)


@pytest.mark.parametrize("layout", ["cpu", "split-kv"])
def test_save_then_load_moves_exact_blocks(layout):
    src_layers, dst_layers = layers(layout), [torch.zeros_like(t) for t in layers(layout)]
    src, dst = PagedKV(src_layers, NUM_BLOCKS), PagedKV(dst_layers, NUM_BLOCKS)
    pool = np.zeros((8, src.block_bytes + 64), dtype=np.uint8)
    blocks, slots = [2, 3, 4, 7], [5, 6, 0, 1]
    sums = sum(src.save_layer(layer, blocks, pool, slots) for layer in range(len(src_layers)))
    for block_sum, slot in zip(sums, slots):
        assert int(block_sum) == checksum(pool[slot, :src.block_bytes])
    targets = [9, 0, 1, 5]
    loaded = dst.load(pool, slots, targets)
    assert list(loaded) == list(sums)
    for t_src, t_dst in zip(src.layers, dst.layers):
        for b, t in zip(blocks, targets):
            assert torch.equal(t_src[b], t_dst[t])
        untouched = [i for i in range(NUM_BLOCKS) if i not in targets]
        assert not t_dst[untouched].any()


def test_head_groups_let_a_tp1_reader_assemble_what_two_tp2_ranks_wrote():
    """PdShmConnector's `head_groups` 2: each rank of a TP 2 prefill writes its half of the KV
    heads of a block into a slot of its own; a TP 1 decode splits its blocks into the same two
    head groups and loads both slots. Its block must equal the block computed at TP 1, and a TP 1
    writer's slots must be what the TP 2 ranks read back."""
    gen = torch.Generator().manual_seed(7)
    heads = 4
    full = [torch.randn(NUM_BLOCKS, heads, 8, 16, generator=gen) for _ in range(2)]  # 2 layers
    ranks = [[t[:, r * 2:(r + 1) * 2].contiguous() for t in full] for r in range(2)]
    writers = [PagedKV(layers_of_rank, NUM_BLOCKS) for layers_of_rank in ranks]
    reader_layers = [torch.zeros_like(t) for t in full]
    reader = PagedKV(reader_layers, NUM_BLOCKS, pieces=2)
    assert reader.block_bytes == writers[0].block_bytes  # one slot size for both TP sizes
    pool = np.zeros((8, reader.block_bytes), dtype=np.uint8)
    blocks = [3, 5]
    slot_of = {(b, g): 2 * i + g for i, b in enumerate(blocks) for g in range(2)}
    for rank, writer in enumerate(writers):
        for layer in range(2):
            writer.save_layer(layer, blocks, pool, [slot_of[b, rank] for b in blocks])
    targets = [1, 6]
    reader.load(pool, [slot_of[b, g] for b in blocks for g in range(2)],
                [t * 2 + g for t in targets for g in range(2)])
    for t_full, t_read in zip(full, reader_layers):
        for b, t in zip(blocks, targets):
            assert torch.equal(t_full[b], t_read[t])
    # the other way: what a TP 1 engine writes as head groups, each TP 2 rank reads as its heads
    pool[:] = 0
    tp1 = PagedKV(full, NUM_BLOCKS, pieces=2)
    for layer in range(2):
        tp1.save_layer(layer, [b * 2 + g for b in blocks for g in range(2)], pool,
                       [slot_of[b, g] for b in blocks for g in range(2)])
    for rank in range(2):
        back = [torch.zeros_like(t) for t in ranks[rank]]
        PagedKV(back, NUM_BLOCKS).load(pool, [slot_of[b, rank] for b in blocks], targets)
        for t_rank, t_back in zip(ranks[rank], back):
            assert torch.equal(t_rank[blocks], t_back[targets])
    with pytest.raises(ValueError, match="cannot be split into 3 parts"):
        PagedKV(reader_layers, NUM_BLOCKS, pieces=3)
