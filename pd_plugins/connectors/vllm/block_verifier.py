"""ws64 digests of blocks in an engine's own paged KV cache (issue 28): what a producer states
and what its consumer checks, computed the same way on both ends.

A block's bytes are block b of layer 0, then of layer 1, and so on (the order of the KV cache
group's layer names), each layer's block in its tensor's memory order with the block dimension
moved first: the layout PdShmConnector's pool slots use (transfer/paged_kv.py). Host rows that are
contiguous are read in place by the numba kernel; anything else (a device tensor, a
[2, num_blocks, ...] layout) goes through the torch formula on the tensor's own device, so only
8 bytes a block come back. Both formulas agree bit for bit (transfer/kv_digest.py).

Engine-agnostic: torch and numpy only.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np
import torch

from pd_plugins.transfer.kv_digest import block_digests, torch_block_digests
from pd_plugins.transfer.paged_kv import block_dim


class BlockVerifier:
    """Digests of whole blocks of every layer; `damage` and `overwrite` for fault injection."""

    def __init__(self, layer_tensors: Sequence[torch.Tensor], num_blocks: int) -> None:
        self.layers = [t.movedim(block_dim(t, num_blocks), 0) for t in layer_tensors]
        self.num_blocks = num_blocks
        self.chunk_bytes = [v[0].numel() * v.element_size() for v in self.layers]
        if any(n % 8 for n in self.chunk_bytes):
            raise ValueError(f"KV block sizes {self.chunk_bytes} are not multiples of 8 bytes")
        self.block_bytes = sum(self.chunk_bytes)
        host = all(v.device.type == "cpu" and v.is_contiguous() for v in self.layers)
        # zero-copy [num_blocks, bytes] views where every layer's block is one host row
        self._rows = ([v.reshape(num_blocks, -1).view(torch.uint8).numpy() for v in self.layers]
                      if host else None)
        # what digesting cost since the last `take_cost` (a push prefill digests on its writer
        # thread, the stats are taken on the main one)
        self._cost_lock = threading.Lock()
        self._seconds, self._bytes = 0.0, 0

    def digests(self, block_ids: Sequence[int]) -> np.ndarray:
        """ws64 of each block (np.uint64, in the order given)."""
        if not len(block_ids):
            return np.zeros(0, dtype=np.uint64)
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block ids outside 0..{self.num_blocks - 1}")
        start = time.perf_counter()
        if self._rows is not None:
            found = block_digests(self._rows, block_ids)
        else:
            found = torch_block_digests(self.layers, block_ids)
        with self._cost_lock:
            self._seconds += time.perf_counter() - start
            self._bytes += len(block_ids) * self.block_bytes
        return found

    def take_cost(self) -> tuple[float, int]:
        """Seconds spent digesting and bytes digested since the last call."""
        with self._cost_lock:
            cost = (self._seconds, self._bytes)
            self._seconds, self._bytes = 0.0, 0
        return cost

    def damage(self, block_id: int, byte: int) -> None:
        """XOR byte `byte` (0 .. block_bytes-1) of block `block_id` with 0xFF, as a stray write
        or a bad transfer would (fault injection only)."""
        for layer, size in zip(self.layers, self.chunk_bytes):
            if byte < size:
                block = layer[block_id]
                raw = block.contiguous().view(-1).view(torch.uint8)  # a copy unless contiguous
                raw[byte] ^= 0xFF
                if raw.data_ptr() != block.data_ptr():
                    block.copy_(raw.view(block.dtype).view(block.shape))
                return
            byte -= size
        raise ValueError(f"byte {byte} is outside the block")

    def overwrite(self, block_id: int, source: int) -> None:
        """Copy block `source` over block `block_id` in every layer, as a block reused by another
        request before it was read would hold (fault injection only)."""
        for layer in self.layers:
            layer[block_id].copy_(layer[source])


def first_mismatch(found: np.ndarray, expected: np.ndarray) -> int | None:
    """The index of the first block whose digest differs (None: all match)."""
    bad = np.flatnonzero(np.asarray(found, dtype=np.uint64) != np.asarray(expected, np.uint64))
    return int(bad[0]) if bad.size else None


def paired_expected(expected: np.ndarray, remote_blocks: int, local_blocks: int
                    ) -> np.ndarray | None:
    """The producer's digests for the blocks a consumer read, in its local order.

    A decode with a local prefix hit reads only its uncomputed suffix, and upstream NIXL end-trims
    the prefill's block list to the same count (docs/plans/kv-verification.md §2, "Upstream NIXL
    read pairing"): local block i holds remote block `remote_blocks - local_blocks + i`. None when
    the counts do not pair (the digests were not taken over the blocks the prefill sent).
    """
    if len(expected) != remote_blocks or not 0 < local_blocks <= remote_blocks:
        return None
    return expected[remote_blocks - local_blocks:]
