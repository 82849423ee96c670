"""`ws64`: the per-block digest a KV producer states and its consumer checks (issue 28).

Over a block's bytes read as little-endian u64 words x_0..x_{n-1} (all layers of the block, in
order), with all arithmetic mod 2**64:

    A = sum(x_i)        B = sum((n - i) * x_i)        digest = fmix64(A ^ fmix64(B))

(fmix64: MurmurHash3's 64-bit finalizer, a bijection.) Why this and not a plain sum or a hash:
one changed word moves A by its difference, so it always changes the pair (A, B); two swapped
words, layers or blocks leave A alone but move B by (x_i - x_j)(j - i), so a swap is caught too
unless that product vanishes mod 2**64 (the two words differ only in high bits and sit a
multiple of a matching power of two apart), which the shm pool's plain sum always misses. When
only one of A and B changes, the digest changes with certainty (each fmix64 is a bijection);
when both change, it stays the same with a chance of about 2**-64. The plan's first mix,
`A ^ (B * 0x9E3779B97F4A7C15)`, was dropped: a flipped top bit (a sign) in half the positions
moved both terms by 2**63 and cancelled (the unit tests found it). It is as fast as xxh3 on
this CPU (docs/plans/kv-verification.md §3), needs no new dependency, and, being sums, it
splits: a block's layers can be summed separately (in a copy that already passes over them, or
on a GPU) and combined exactly (`combine`):

    B = sum_l (B_l + (n - off_l - n_l) * A_l)     (layer l: n_l words at word offset off_l)

It catches accidents (bit flips, torn, stale or misplaced blocks), not an attacker who can write
KV (or, where the digests travel beside the KV, state them). Not every peer is authenticated:
transfer/peer_auth.py signs SGLang's bootstrap-registry calls, but vLLM's NIXL side channel and
notifications (PdNixlConnector's push digests among them) are not, so a NIXL peer can write KV
and send notifications; a push decode takes digests only from its prefill's NIXL agents, which
stops another peer from replacing them but is no authentication (docs/security.md).

The same integer formula runs as a numba kernel on host KV (`block_digests`) and as torch
integer ops on a device tensor (`torch_block_digests`: no copy of the KV to the host, 8 bytes
per block come back). torch's int64 arithmetic wraps like u64 (two's complement), so the two
agree bit for bit (tests/unit/transfer/test_kv_digest.py checks it on CPU; on a GPU it is still
to be checked). torch on a CPU is ~10x slower than the kernel: use the kernel for host KV.

Engine-agnostic: numpy, numba and torch only.
"""

from __future__ import annotations

import base64
from typing import Sequence

import numba
import numpy as np

ALGO = "ws64"
_MASK = (1 << 64) - 1
FMIX_C1, FMIX_C2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # MurmurHash3's fmix64

jit = numba.njit(cache=True, nogil=True)  # nogil: a transfer thread digests beside the engine


@jit
def row_partials(rows, ids, out_a, out_b):
    """(A, B) of rows ids[r] of `rows` ([n_rows, words] u64), each as a block of its own:
    out_a[r] = sum(x), out_b[r] = sum((words - j) * x_j), mod 2**64. The rows are read where
    they are (no gather copy)."""
    words = rows.shape[1]
    for r in range(ids.shape[0]):
        row = rows[ids[r]]
        a = np.uint64(0)
        b = np.uint64(0)
        for j in range(words):
            x = row[j]
            a += x
            b += np.uint64(words - j) * x
        out_a[r] = a
        out_b[r] = b


def _words(rows: np.ndarray) -> np.ndarray:
    """Rows of any dtype ([n, ...], each row contiguous in memory) as [n, words] u64, a view."""
    flat = rows.reshape(rows.shape[0], -1)
    if flat.shape[1] and flat.strides[1] != flat.itemsize:
        flat = np.ascontiguousarray(flat)
    raw = flat.view(np.uint8)
    if raw.shape[1] % 8:
        raise ValueError(f"ws64 reads 8-byte words: a row of {raw.shape[1]} bytes is not whole")
    return raw.view(np.uint64)


def partials(rows: np.ndarray, ids: Sequence[int] | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """`row_partials` of rows `ids` (default: all) of `rows` ([n_rows, ...], any dtype, a
    multiple of 8 bytes per row)."""
    words = _words(rows)
    at = (np.arange(words.shape[0], dtype=np.int64) if ids is None
          else np.asarray(ids, dtype=np.int64))
    a, b = np.empty(at.size, np.uint64), np.empty(at.size, np.uint64)
    row_partials(words, at, a, b)
    return a, b


def combine(parts: Sequence[tuple[np.ndarray, np.ndarray]], widths: Sequence[int]
            ) -> tuple[np.ndarray, np.ndarray]:
    """Each block's (A, B) from its consecutive pieces' partials (`parts[l]`: arrays over the
    blocks; `widths[l]`: words in piece l of every block)."""
    total = int(sum(widths))
    a = np.zeros_like(parts[0][0])
    b = np.zeros_like(parts[0][0])
    after = total
    with np.errstate(over="ignore"):
        for (pa, pb), width in zip(parts, widths):
            after -= width  # words of the block after this piece: n - off_l - n_l
            a += pa
            b += pb + np.uint64(after) * pa
    return a, b


def _fmix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(33))) * np.uint64(FMIX_C1)
        z = (z ^ (z >> np.uint64(33))) * np.uint64(FMIX_C2)
        return z ^ (z >> np.uint64(33))


def finish(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The digests of blocks with partials (A, B)."""
    return _fmix64(a ^ _fmix64(b))


def digest(data: np.ndarray) -> int:
    """ws64 of one block's bytes (a multiple of 8)."""
    a, b = partials(np.ascontiguousarray(data).reshape(1, -1).view(np.uint8))
    return int(finish(a, b)[0])


def block_digests(layer_rows: Sequence[np.ndarray], block_ids: Sequence[int]) -> np.ndarray:
    """ws64 of blocks `block_ids` of a paged host KV cache: `layer_rows[l]` is layer l as
    [num_blocks, bytes] (any dtype; a block's bytes are its layers' rows in order)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    parts, widths = [], []
    for rows in layer_rows:
        words = _words(rows)
        parts.append(partials(words, ids))
        widths.append(words.shape[1])
    return finish(*combine(parts, widths))


def torch_block_digests(layer_tensors: Sequence, block_ids: Sequence[int]) -> np.ndarray:
    """`block_digests` on the tensors' own device: `layer_tensors[l]` is [num_blocks, ...]
    (block dimension first). Only the digests (8 bytes a block) leave the device."""
    import torch

    device = layer_tensors[0].device
    ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
    widths = [t[0].numel() * t.element_size() // 8 for t in layer_tensors]
    total = sum(widths)
    a = torch.zeros(len(ids), dtype=torch.int64, device=device)
    b = torch.zeros_like(a)
    after = total
    for t, width in zip(layer_tensors, widths):
        rows = t.index_select(0, ids).reshape(len(ids), -1).view(torch.uint8)
        if rows.shape[1] % 8:
            raise ValueError(f"ws64 reads 8-byte words: a row of {rows.shape[1]} bytes is not whole")
        words = rows.view(torch.int64)
        weights = torch.arange(width, 0, -1, dtype=torch.int64, device=device)
        pa, pb = words.sum(dim=1), (words * weights).sum(dim=1)  # int64 wraps as u64 does
        after -= width
        a += pa
        b += pb + after * pa
    return _torch_fmix64(a ^ _torch_fmix64(b)).cpu().numpy().view(np.uint64)


def _torch_fmix64(z):
    """fmix64 in int64 ops: constants as their signed bits, `>>` made logical by a mask."""
    c1, c2 = FMIX_C1 - (1 << 64), FMIX_C2 - (1 << 64)
    low31 = (1 << 31) - 1  # what a logical shift by 33 keeps
    z = (z ^ ((z >> 33) & low31)) * c1
    z = (z ^ ((z >> 33) & low31)) * c2
    return z ^ ((z >> 33) & low31)


def reference_digest(data: bytes) -> int:
    """ws64 in plain Python integers: the definition the kernels are tested against."""
    words = [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)]
    n = len(words)
    a = sum(words) & _MASK
    b = sum((n - i) * x for i, x in enumerate(words)) & _MASK
    return _reference_fmix64(a ^ _reference_fmix64(b))


def _reference_fmix64(z: int) -> int:
    z = ((z ^ (z >> 33)) * FMIX_C1) & _MASK
    z = ((z ^ (z >> 33)) * FMIX_C2) & _MASK
    return z ^ (z >> 33)


# -- on the wire ----------------------------------------------------------------------------------
def encode(digests: np.ndarray) -> str:
    """Digests as text for kv_transfer_params (base64 of little-endian u64s)."""
    return base64.b64encode(np.asarray(digests, dtype="<u8").tobytes()).decode("ascii")


def decode(text: object, max_blocks: int) -> np.ndarray:
    """A peer's `encode`d digests; ValueError if not text of whole digests or more than
    `max_blocks` of them (the text comes over the network: its size is checked before it is
    decoded)."""
    if not isinstance(text, str):
        raise ValueError(f"digests must be a string, not {type(text).__name__}")
    if len(text) > 4 * -(-8 * max_blocks // 3):
        raise ValueError(f"more than {max_blocks} digests")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise ValueError(f"digests are not base64: {exc}") from None
    if len(raw) % 8:
        raise ValueError(f"{len(raw)} bytes are not whole 8-byte digests")
    return np.frombuffer(raw, dtype="<u8").astype(np.uint64)
