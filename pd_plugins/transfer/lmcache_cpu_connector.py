"""LMCache's `GPUConnectorInterface` for paged KV caches in host memory (no CUDA).

LMCache moves KV between an engine and its storage through a "GPU connector": `from_gpu` fills a
`MemoryObj` (one chunk of tokens, every layer) from the engine's KV cache, `to_gpu` writes one
back. LMCache's own connectors need CUDA kernels; this one is torch only, for engines whose KV
cache lives in CPU memory (vLLM CPU). A device KV cache works too (gather on the device, one copy
to host), but without LMCache's CUDA kernels, and it is untested on a GPU here.

Only whole blocks move: a chunk is `chunk_size // block_size` blocks, so a chunk's `MemoryObj`
(shape [1, layers, chunk_size, elements_per_token]) is viewed as [layers, blocks, block elements]
and each layer is one `index_select` (store) or `index_copy_` (load) on the block dimension.
The bytes of a block are kept in the engine's own order: the pool's key carries a layout
fingerprint, so only engines with the same layout ever read them.

Per call, kwargs carry `layers` (the engine's KV tensors as [num_blocks, *block] views, one per
layer; a [2, num_blocks, ...] layer is a strided view and index_copy_ writes through it),
`block_ids` (block of token i is block_ids[i // block_size]), `skip_tokens` (loads leave blocks below it alone: the engine's own prefix cache holds them),
`ticket` (a `CopyTicket`: copies stop once the caller has given up on the call) and `progress`
(a dict counting tokens and bytes copied).
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj


class CopyCancelled(RuntimeError):
    """The caller timed out: the engine may already reuse the blocks, so nothing may be copied."""


class CopyTicket:
    """Shared by a caller and the LMCache thread running its call. `cancel()` waits for a copy in
    progress (a bounded memory copy), after which no copy touches the engine's blocks."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True


class CPUPagedKVConnector(GPUConnectorInterface):
    """Copies whole blocks between an engine's per-layer paged KV tensors and LMCache chunks."""

    def __init__(self, num_layers: int, block_size: int, layer_block_shape: Sequence[int],
                 dtype: torch.dtype) -> None:
        self.num_layers, self.block_size, self.dtype = num_layers, block_size, dtype
        self.block_elems = math.prod(layer_block_shape)
        if self.block_elems % block_size:
            raise ValueError(f"a block of {self.block_elems} elements does not split into "
                             f"{block_size} tokens")
        self.token_elems = self.block_elems // block_size
        self.kvcaches = None  # LMCache's attribute; the KV views come with each call

    def check_layers(self, layers: Sequence[torch.Tensor]) -> None:
        """Checks an engine's per-layer KV views ([num_blocks, *block], see paged_kv.block_dim)."""
        if len(layers) != self.num_layers:
            raise ValueError(f"got {len(layers)} KV layers, the layout has {self.num_layers}")
        for view in layers:
            if view[0].numel() != self.block_elems or view.dtype != self.dtype:
                raise ValueError(f"KV layer {tuple(view.shape)} {view.dtype}: expected blocks of "
                                 f"{self.block_elems} {self.dtype} elements")

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([1, self.num_layers, num_tokens, self.token_elems])

    def _chunk_blocks(self, memory_obj: MemoryObj, start: int, end: int, block_ids: Sequence[int]):
        if start % self.block_size or end % self.block_size:
            raise ValueError(f"chunk [{start}, {end}) is not whole blocks of {self.block_size}")
        first, last = start // self.block_size, end // self.block_size
        rows = memory_obj.tensor.view(self.num_layers, last - first, self.block_elems)
        return rows, list(block_ids[first:last]), first

    # -- LMCache side ---------------------------------------------------------------------------
    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        ticket: CopyTicket = kwargs.get("ticket") or CopyTicket()
        layers = kwargs["layers"]
        with ticket.lock:
            if ticket.cancelled:  # the put must not go ahead with unfilled chunks
                for obj in memory_objs:
                    obj.ref_count_down()
                raise CopyCancelled("store abandoned by its caller")
            for obj, start, end in zip(memory_objs, starts, ends):
                rows, ids, _ = self._chunk_blocks(obj, start, end, kwargs["block_ids"])
                index = torch.tensor(ids, dtype=torch.long, device=layers[0].device)
                for layer, view in enumerate(layers):
                    out = rows[layer].view(len(ids), *view.shape[1:])
                    if view.device.type == "cpu":
                        torch.index_select(view, 0, index, out=out)
                    else:  # gather on the device, then one copy to host memory
                        out.copy_(view.index_select(0, index))
                self._count(kwargs, end - start, rows)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        ticket: CopyTicket = kwargs.get("ticket") or CopyTicket()
        skip_blocks = kwargs.get("skip_tokens", 0) // self.block_size
        layers = kwargs["layers"]
        with ticket.lock:
            if ticket.cancelled:
                return
            for obj, start, end in zip(memory_objs, starts, ends):
                rows, ids, first = self._chunk_blocks(obj, start, end, kwargs["block_ids"])
                keep = max(0, skip_blocks - first)  # leading blocks of this chunk to leave alone
                if keep >= len(ids):
                    continue
                index = torch.tensor(ids[keep:], dtype=torch.long, device=layers[0].device)
                for layer, view in enumerate(layers):
                    src = rows[layer, keep:].view(len(index), *view.shape[1:])
                    view.index_copy_(0, index, src.to(view.device))
                self._count(kwargs, (len(ids) - keep) * self.block_size, rows[:, keep:])

    @staticmethod
    def _count(kwargs: dict, tokens: int, rows: torch.Tensor) -> None:
        progress = kwargs.get("progress")
        if progress is not None:
            progress["tokens"] = progress.get("tokens", 0) + tokens
            progress["bytes"] = progress.get("bytes", 0) + rows.numel() * rows.element_size()
