"""ws64 (transfer/kv_digest.py): the numba kernel and the torch formula against the definition in
plain Python integers; what it catches (any changed word, swapped words, layers or blocks); layer
partials combining exactly into the block's digest; the wire form and its bounds."""

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pd_plugins.transfer import kv_digest
from pd_plugins.transfer.kv_digest import (
    block_digests,
    combine,
    decode,
    digest,
    encode,
    finish,
    partials,
    reference_digest,
    torch_block_digests,
)

U64 = st.integers(0, (1 << 64) - 1)
WORDS = st.lists(U64, min_size=1, max_size=64)


def as_bytes(words: list[int]) -> bytes:
    return b"".join(w.to_bytes(8, "little") for w in words)


def as_array(words: list[int]) -> np.ndarray:
    return np.array(words, dtype=np.uint64)


def paged_cache(rng, num_blocks=12):
    """Three layers of different dtypes and widths, as a paged KV cache holds them, with values
    that overflow every sum."""
    return [rng.standard_normal((num_blocks, 2, 16)).astype(np.float32),
            rng.integers(0, 1 << 63, (num_blocks, 5), dtype=np.int64) * 3,
            rng.integers(0, 1 << 16, (num_blocks, 64), dtype=np.uint16)]


def block_bytes(layers, block: int) -> bytes:
    return b"".join(layer[block].tobytes() for layer in layers)


# -- the kernels compute the definition -----------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(WORDS)
def test_kernel_equals_the_definition(words):
    assert digest(as_array(words)) == reference_digest(as_bytes(words))


def test_block_digests_of_a_paged_cache_equal_the_definition():
    layers = paged_cache(np.random.default_rng(1))
    ids = [5, 0, 11, 5]
    assert block_digests(layers, ids).tolist() == [
        reference_digest(block_bytes(layers, b)) for b in ids]


def test_torch_formula_is_bit_identical_to_the_kernel_on_cpu():
    rng = np.random.default_rng(2)
    for _ in range(5):
        layers = paged_cache(rng)
        ids = rng.permutation(12)[:7].tolist()
        expected = block_digests(layers, ids)
        got = torch_block_digests([torch.from_numpy(layer) for layer in layers], ids)
        assert got.dtype == np.uint64 and got.tolist() == expected.tolist()


def test_torch_formula_on_extreme_words():
    """Words at the signed/unsigned boundary: torch's int64 wraps as u64 does."""
    words = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1] * 7
    cache = torch.from_numpy(as_array(words).view(np.int64)).reshape(1, -1)
    assert torch_block_digests([cache], [0]).tolist() == [reference_digest(as_bytes(words))]


# -- what it catches ------------------------------------------------------------------------------
def digests_of_rows(rows: np.ndarray) -> list[int]:
    return finish(*partials(rows)).tolist()


@pytest.mark.parametrize("block", ["random", "zeros", "ones", "sign bits"])
def test_every_flipped_bit_of_every_word_changes_the_digest(block):
    """Exhaustive over a 64-word block: 4096 flips, one kernel call."""
    words = {"random": np.random.default_rng(6).integers(0, 1 << 63, 64, dtype=np.uint64) * 2 + 1,
             "zeros": np.zeros(64, np.uint64), "ones": np.full(64, (1 << 64) - 1, np.uint64),
             "sign bits": np.full(64, 1 << 63, np.uint64)}[block]
    flips = np.repeat(words[None, :], 64 * 64, axis=0)
    position, bit = np.divmod(np.arange(64 * 64), 64)
    flips[np.arange(64 * 64), position] ^= np.uint64(1) << bit.astype(np.uint64)
    original = digest(words)
    assert original not in digests_of_rows(flips)


@settings(max_examples=100, deadline=None)
@given(WORDS, st.data())
def test_any_changed_word_changes_the_digest(words, data):
    i = data.draw(st.integers(0, len(words) - 1))
    new = data.draw(U64.filter(lambda v: v != words[i]))
    changed = list(words)
    changed[i] = new
    assert digest(as_array(changed)) != digest(as_array(words))


@settings(max_examples=100, deadline=None)
@given(st.lists(U64, min_size=2, max_size=64, unique=True), st.data())
def test_two_swapped_words_change_the_digest(words, data):
    """Certain: a swap leaves A alone and moves B, and the digest is a bijection of B then."""
    i, j = data.draw(st.lists(st.integers(0, len(words) - 1), min_size=2, max_size=2,
                              unique=True))
    # the one swap that leaves (A, B) alone, documented in kv_digest.py
    assume((words[i] - words[j]) * (j - i) % (1 << 64) != 0)
    swapped = list(words)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    assert digest(as_array(swapped)) != digest(as_array(words))


def test_swapped_layers_and_swapped_blocks_are_caught_where_a_plain_sum_is_not():
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 1 << 63, 512, dtype=np.uint64), rng.integers(0, 1 << 63, 512,
                                                                      dtype=np.uint64)
    plain_sum = lambda x: int(np.add.reduce(x, dtype=np.uint64))  # the shm pool's checksum
    ab, ba = np.concatenate([a, b]), np.concatenate([b, a])  # two layers (or chunks) swapped
    assert plain_sum(ab) == plain_sum(ba)
    assert digest(ab) != digest(ba)
    # two blocks' contents exchanged: each block's digest no longer matches its own statement
    layers = [np.stack([a, b])]
    stated = block_digests(layers, [0, 1])
    exchanged = [np.stack([b, a])]
    assert (block_digests(exchanged, [0, 1]) != stated).all()


def test_a_misplaced_block_is_caught():
    """Another block's bytes in the right place (a reused or stale block)."""
    layers = paged_cache(np.random.default_rng(4))
    stated = block_digests(layers, range(12))
    assert len(set(stated.tolist())) == 12
    for layer in layers:
        layer[3] = layer[9]
    assert block_digests(layers, [3])[0] != stated[3]


# -- layer partials combine exactly -----------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(U64, min_size=1, max_size=16), min_size=1, max_size=6))
def test_partial_sums_of_pieces_combine_to_the_whole_block_digest(pieces):
    parts = [partials(as_array(piece).reshape(1, -1)) for piece in pieces]
    combined = finish(*combine(parts, [len(p) for p in pieces]))
    whole = [w for piece in pieces for w in piece]
    assert int(combined[0]) == reference_digest(as_bytes(whole))


def test_partials_of_many_blocks_combine_per_block():
    rng = np.random.default_rng(5)
    layers = paged_cache(rng)
    ids = list(range(12))
    parts = [partials(layer.reshape(12, -1)) for layer in layers]
    widths = [layer[0].nbytes // 8 for layer in layers]
    assert finish(*combine(parts, widths)).tolist() == block_digests(layers, ids).tolist()


def test_rows_that_are_not_whole_words_are_refused():
    with pytest.raises(ValueError, match="8-byte words"):
        partials(np.zeros((2, 12), np.uint8))


# -- on the wire ------------------------------------------------------------------------------------
def test_encode_decode_round_trip():
    digests = np.array([0, 1, (1 << 64) - 1, kv_digest.FMIX_C1], dtype=np.uint64)
    assert decode(encode(digests), max_blocks=4).tolist() == digests.tolist()
    assert decode(encode(digests[:0]), max_blocks=0).tolist() == []


@pytest.mark.parametrize("text, why", [
    (123, "must be a string"),
    ("!!!!", "not base64"),
    ("AAAA", "not whole 8-byte digests"),
    ("A" * 10_000, "more than 4 digests"),
])
def test_decode_refuses_what_is_not_a_bounded_digest_list(text, why):
    with pytest.raises(ValueError, match=why):
        decode(text, max_blocks=4)


def test_every_swap_of_two_words_changes_the_digest():
    """Exhaustive over a 64-word block of distinct random words: all 2016 swaps."""
    words = np.random.default_rng(7).integers(0, 1 << 63, 64, dtype=np.uint64) * 2 + 1
    pairs = [(i, j) for i in range(64) for j in range(i + 1, 64)]
    swaps = np.repeat(words[None, :], len(pairs), axis=0)
    for row, (i, j) in enumerate(pairs):
        swaps[row, [i, j]] = words[[j, i]]
    assert digest(words) not in digests_of_rows(swaps)


def test_layer_views_that_are_slices_of_wider_rows_are_read_in_place():
    """A pool slot or a fused KV tensor: each layer a column range of one row per block."""
    rows = np.random.default_rng(8).integers(0, 255, (6, 512), dtype=np.uint8)
    views = [rows[:, i * 128:(i + 1) * 128] for i in range(4)]
    assert block_digests(views, [4, 1]).tolist() == [
        reference_digest(rows[b].tobytes()) for b in (4, 1)]
