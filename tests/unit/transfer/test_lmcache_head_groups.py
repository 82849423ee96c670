"""HeadGroupPools (transfer/lmcache_head_groups.py): engines of different TP sizes share one LMCache
pool through a real fs:// backend (a shared directory), in vLLM's CPU layout.

A TP 2 engine's rank holds half of the KV heads of every block; a TP 1 engine holds them all. With
two head groups, each TP 2 rank stores its group and a TP 1 reader assembles both groups into its
own blocks (and the other way round), bit-exact; a chunk one group lacks counts as absent.
"""

from __future__ import annotations

import pytest
import torch

from pd_plugins.transfer.lmcache_head_groups import HeadGroupPools, groups_of_rank
from pd_plugins.transfer.lmcache_pool import LMCachePool

# imported at collection: LMCache's log handler then writes to the real stderr, not to the
# capture of the first test that opens a pool (closed by the time LMCache logs its close)
pytest.importorskip("lmcache.v1.cache_engine")

LAYERS, BLOCKS, HEADS, BS, HS2 = 2, 16, 2, 16, 8  # vLLM CPU: [blocks, heads, block_size, 2*head]
CHUNK, GROUPS = 32, 2
TOKENS = [500 + 3 * i for i in range(2 * CHUNK + 5)]  # 2 full chunks and a tail
FULL = 2 * CHUNK
SRC_BLOCKS, DST_BLOCKS = [7, 2, 11, 4, 9], [1, 3, 5, 12, 14]


def engine_kv(heads: int, seed: int | None) -> list[torch.Tensor]:
    """One engine rank's per-layer KV tensors (zeros when `seed` is None)."""
    if seed is None:
        return [torch.zeros(BLOCKS, heads, BS, HS2) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(BLOCKS, heads, BS, HS2, generator=gen) for _ in range(LAYERS)]


def rank_pools(backend: str, name: str, tp: int, rank: int, kv: list[torch.Tensor]):
    """What PdLMCacheConnector opens on rank `rank` of a TP `tp` engine with head_groups 2."""
    def open_group(group: int) -> LMCachePool:
        return LMCachePool(backend, layout="tiny|float32|head_groups=2", num_layers=LAYERS,
                           block_size=BS, chunk_size=CHUNK, kv_dtype=torch.float32,
                           layer_block_shape=(HEADS // GROUPS, BS, HS2), rank=group,
                           world_size=GROUPS, local_cpu_gb=0.02, timeout_s=5.0,
                           instance_id=f"{name}-r{rank}-g{group}")

    pools = HeadGroupPools(groups_of_rank(GROUPS, tp, rank), open_group)
    try:
        pools.attach_kv(kv, BLOCKS)
    except BaseException:
        pools.close()
        raise
    return pools


def block_of_heads(kv: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    return [layer[block] for layer in kv]


def test_groups_of_rank():
    assert list(groups_of_rank(2, 1, 0)) == [0, 1]
    assert [list(groups_of_rank(4, 2, r)) for r in (0, 1)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="not a multiple of the TP size"):
        groups_of_rank(3, 2, 0)


def test_tp2_ranks_store_and_a_tp1_engine_assembles_their_heads(tmp_path):
    backend = f"fs://{tmp_path}"
    full = engine_kv(HEADS, seed=1)  # what a TP 1 engine would hold
    ranks = [[layer[:, r:r + 1].clone() for layer in full] for r in (0, 1)]
    writers = [rank_pools(backend, "p", 2, r, ranks[r]) for r in (0, 1)]
    reader_kv = engine_kv(HEADS, seed=None)
    reader = rank_pools(backend, "d", 1, 0, reader_kv)
    try:
        assert writers[0].store(TOKENS, SRC_BLOCKS) == FULL
        assert reader.lookup(TOKENS) == 0  # group 1 is not there yet: no chunk counts
        assert reader.retrieve(TOKENS, DST_BLOCKS) == 0
        assert writers[1].store(TOKENS, SRC_BLOCKS) == FULL
        assert reader.lookup(TOKENS) == FULL
        assert reader.retrieve(TOKENS, DST_BLOCKS) == FULL
        for src, dst in zip(SRC_BLOCKS[:FULL // BS], DST_BLOCKS[:FULL // BS]):
            for got, want in zip(block_of_heads(reader_kv, dst), block_of_heads(full, src)):
                assert torch.equal(got, want)
        untouched = set(range(BLOCKS)) - set(DST_BLOCKS[:FULL // BS])
        assert not any(reader_kv[0][b].any() for b in untouched)
    finally:
        for pools in (*writers, reader):
            pools.close()


def test_a_tp1_engine_stores_and_each_tp2_rank_reads_its_own_heads(tmp_path):
    backend = f"fs://{tmp_path}"
    full = engine_kv(HEADS, seed=2)
    writer = rank_pools(backend, "p", 1, 0, full)
    reader_kvs = [engine_kv(1, seed=None) for _ in (0, 1)]
    readers = [rank_pools(backend, "d", 2, r, reader_kvs[r]) for r in (0, 1)]
    try:
        assert writer.store(TOKENS, SRC_BLOCKS) == FULL
        for r in (0, 1):
            assert readers[r].retrieve(TOKENS, DST_BLOCKS, skip_tokens=BS) == FULL
            for layer, want_layer in zip(reader_kvs[r], full):
                assert torch.equal(layer[DST_BLOCKS[1]], want_layer[SRC_BLOCKS[1], r:r + 1])
                assert not layer[DST_BLOCKS[0]].any()  # below skip_tokens: left alone
    finally:
        for pools in (writer, *readers):
            pools.close()


def test_heads_that_do_not_split_are_refused_when_the_kv_is_attached(tmp_path):
    with pytest.raises(ValueError, match="does not split into this rank's 2 head groups"):
        rank_pools(f"fs://{tmp_path}", "odd", 1, 0, engine_kv(3, seed=None))
