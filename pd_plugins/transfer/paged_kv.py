"""Paged KV caches as the shared-memory pool stores them: one slot = one block of every layer.

An engine keeps one KV tensor per layer with a block dimension (vLLM CPU: [num_blocks, heads,
block_size, 2 * head_size]; vLLM flash-attention: [2, num_blocks, ...]). A pool slot is the bytes
of block b of layer 0, then of layer 1, and so on, each chunk 8-byte aligned so per-chunk
checksums add up to the slot's checksum.

Copies go block to slot through shm_pool.copy_runs (one compiled pass per batch that copies and
sums, its stores around the caches; torch's advanced indexing copies byte by byte on uint8 and
ran at 0.2 GB/s).
A layer whose blocks are not contiguous rows in host memory (a GPU cache, a [2, num_blocks, ...]
layout) is gathered into host rows first. Engine-agnostic: torch and numpy only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from pd_plugins.transfer.shm_pool import copy_runs, row_checksums


def block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a layer's KV tensor that indexes blocks (0 or 1 in known layouts)."""
    for dim in (0, 1):
        if tensor.dim() > dim and tensor.shape[dim] == num_blocks:
            return dim
    raise ValueError(f"no block dimension of size {num_blocks} in KV tensor {tuple(tensor.shape)}")


class PagedKV:
    """Copies whole blocks of every layer between an engine's KV cache and pool slots.

    `pieces` > 1 splits each block along the dimension after the block one (the KV heads in vLLM's
    CPU layout) into that many equal parts, each a block of its own: part j of block b is block
    b * pieces + j, one pool slot. A pool then holds a block as head groups that engines of
    different TP sizes can each take their own heads from (PdShmConnector's `head_groups`).
    Needs the blocks as contiguous host rows."""

    def __init__(self, layer_tensors: Sequence[torch.Tensor], num_blocks: int,
                 pieces: int = 1) -> None:
        self.layers = [t.movedim(block_dim(t, num_blocks), 0) for t in layer_tensors]
        if pieces > 1:
            for v in self.layers:
                if v.device.type != "cpu" or not v.is_contiguous() or v.shape[1] % pieces:
                    raise ValueError(f"KV tensor {tuple(v.shape)} cannot be split into {pieces} "
                                     "parts per block (needs contiguous host rows whose second "
                                     "dimension divides)")
            self.layers = [v.reshape(num_blocks * pieces, v.shape[1] // pieces, *v.shape[2:])
                           for v in self.layers]
            num_blocks *= pieces
        self.chunk_bytes = [v[0].numel() * v.element_size() for v in self.layers]
        if any(n % 8 for n in self.chunk_bytes):
            raise ValueError(f"KV block sizes {self.chunk_bytes} are not multiples of 8 bytes")
        self.offsets = [int(x) for x in np.cumsum([0] + self.chunk_bytes[:-1])]
        self.block_bytes = sum(self.chunk_bytes)
        # zero-copy [num_blocks, chunk_bytes] views where a block is one contiguous host row
        self._rows = [v.reshape(num_blocks, -1).view(torch.uint8).numpy()
                      if v.device.type == "cpu" and v.is_contiguous() else None
                      for v in self.layers]

    def _columns(self, pool_rows: np.ndarray, layer: int) -> np.ndarray:
        off = self.offsets[layer]
        return pool_rows[:, off:off + self.chunk_bytes[layer]]

    def save_layer(self, layer: int, block_ids: Sequence[int], pool_rows: np.ndarray,
                   slots: Sequence[int], checksums: bool = True) -> np.ndarray:
        """Copy one layer of `block_ids` into `slots` of pool_rows ([num_slots, slot_bytes]
        uint8); returns the per-block checksums of what was copied (zeros when off)."""
        src, index = self._rows[layer], list(block_ids)
        if src is None:  # gather into host rows first
            ids = torch.tensor(index, dtype=torch.long, device=self.layers[layer].device)
            src = self.layers[layer][ids].reshape(len(index), -1).view(torch.uint8).cpu().numpy()
            index = list(range(len(index)))
        return copy_runs(src, index, self._columns(pool_rows, layer), slots,
                         sum_source=True if checksums else None)

    def load(self, pool_rows: np.ndarray, slots: Sequence[int], block_ids: Sequence[int],
             checksums: bool = True) -> np.ndarray:
        """Copy `slots` (every layer) into `block_ids`; returns per-block checksums of the copies
        as they landed in the KV cache (compare with the pool's to catch a torn copy), or zeros
        when `checksums` is off."""
        sums = np.zeros(len(block_ids), dtype=np.uint64)
        for layer, dst in enumerate(self._rows):
            src = self._columns(pool_rows, layer)
            if dst is None:  # stage in host rows, then scatter into the device tensor
                staged = np.stack([src[s] for s in slots])
                if checksums:
                    sums += row_checksums(staged)
                view = self.layers[layer]
                values = torch.from_numpy(staged).view(view.dtype).reshape(len(slots),
                                                                           *view.shape[1:])
                view[torch.tensor(list(block_ids), device=view.device)] = values.to(view.device)
                continue
            sums += copy_runs(src, slots, dst, block_ids,
                              sum_source=False if checksums else None)
        return sums
