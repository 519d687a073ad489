"""Paged KV memory: ONE preallocated tensor per worker.

Layout [num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim], contiguous:
one block (all layers) is one contiguous byte range (a store object) and one layer of one
block is one contiguous piece (a layer-wise streaming unit). The transfer engine and the
store read and write raw bytes at block_address / layer_address.

The tensor is stored in the KV dtype (``kv_dtype``, possibly narrower than the compute
dtype: writes cast, readers cast back). With ``shm_path`` it lives in a file in /dev/shm
created here exclusively, so a same-host peer can map it and write KV with a plain tensor
copy (common/kv/shm_kv.py); the addresses and layout are the same either way.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np
import torch

from common.kv.dtypes import KV_DTYPE_NAMES
from common.store.shm import Segment

log = logging.getLogger(__name__)

KV_DTYPES = {name: getattr(torch, name) for name in KV_DTYPE_NAMES}


class PagedKVMemory:
    def __init__(self, num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", shm_path: Optional[str] = None):
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        self.segment: Optional[Segment] = None
        if shm_path is not None:
            if torch.device(device).type != "cpu":
                raise ValueError(f"a shared-memory KV segment is host memory, not {device}")
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            try:
                self.segment = Segment(nbytes, shm_path, create=True)  # exclusive, zeroed
            except OSError as exc:  # e.g. a small /dev/shm: peers use the transfer engine
                log.warning("KV memory not shared: cannot create %s (%d MiB): %s",
                            shm_path, nbytes >> 20, exc)
        if self.segment is None:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        else:
            raw = torch.frombuffer(self.segment.view(0, self.segment.nbytes), dtype=torch.uint8)
            self.data = raw.view(dtype).view(shape)
        assert self.data.is_contiguous()
        self.layer_nbytes = 2 * block_size * num_kv_heads * head_dim * self.data.element_size()
        self.block_nbytes = num_layers * self.layer_nbytes

    def host_bytes(self) -> np.ndarray:
        """The whole memory as a flat uint8 array (host memory only; no copy)."""
        return self.data.view(-1).view(torch.uint8).numpy()

    @property
    def shm_path(self) -> Optional[str]:
        """The /dev/shm file same-host peers may map; None for private memory."""
        return self.segment.path if self.segment is not None else None

    def close(self) -> None:
        """Unlink the shared file (the mapping itself lives until the process exits, since
        the model's tensors still point into it). Idempotent; a no-op for private memory."""
        if self.segment is not None:
            self.segment.close(unlink=True)
            self.segment = None

    @property
    def in_host_memory(self) -> bool:
        """False for GPU memory, which a ``memmove`` (a /dev/shm peer's path) cannot read:
        its bytes go through the transfer engine."""
        return not self.data.is_cuda

    def window(self, first_layer: int, total_layers: Optional[int]) -> int:
        """A pipeline stage holds layers [first_layer, first_layer + num_layers) of a model
        of ``total_layers`` (None: these are all of them): that model's layer count, or
        ValueError where the window does not fit it."""
        total = self.num_layers if total_layers is None else total_layers
        if not 0 <= first_layer <= total - self.num_layers:
            raise ValueError(f"layers from {first_layer} of {self.num_layers} do not fit a "
                             f"model of {total}")
        return total

    @property
    def device_bytes(self) -> Optional[torch.Tensor]:
        """The KV memory as flat bytes when it is on a GPU (what its same-host copies
        index: common/kv/rows.py); None in host memory."""
        return None if self.in_host_memory else self.data.view(-1).view(torch.uint8)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def base_address(self) -> int:
        return self.data.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} out of range [0, {self.num_blocks})")

    def block_address(self, block: int) -> int:
        self._check_block(block)
        return self.base_address + block * self.block_nbytes

    def layer_address(self, block: int, layer: int) -> int:
        self._check_block(block)
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        return self.block_address(block) + layer * self.layer_nbytes

    def layer_view(self, layer: int) -> torch.Tensor:
        """[num_blocks, 2, block_size, kv_heads, head_dim] strided view of one layer."""
        return self.data[:, layer]

    def block_bytes(self, block: int) -> torch.Tensor:
        """uint8 view of one whole block (all layers): a zero-copy handle on its bytes."""
        self._check_block(block)
        return self.data[block].view(-1).view(torch.uint8)

    def layer_bytes(self, block: int, layer: int) -> torch.Tensor:
        """uint8 view of one layer of one block."""
        self._check_block(block)
        return self.data[block, layer].reshape(-1).view(torch.uint8)

    def write_tokens(self, layer: int, block_table: torch.Tensor, positions: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [T, kv_heads, head_dim] of tokens at `positions` of a sequence or batch.

        `block_table[i]` is the block holding token i's position (already looked up).
        """
        offsets = positions % self.block_size
        self.data[block_table, layer, 0, offsets] = k.to(self.dtype)
        self.data[block_table, layer, 1, offsets] = v.to(self.dtype)

    def token_rows(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layer-0 K rows of tokens for write_rows: computed once per step, reused by layers.

        A row is one token's [kv_heads, head_dim] in `data.view(-1, kv_heads, head_dim)`;
        layer l's K row is `rows + 2*l*block_size`, its V row that plus block_size.
        """
        return (block_table * (self.num_layers * 2 * self.block_size)
                + positions % self.block_size)

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """write_tokens with the rows precomputed by token_rows (two index_copy_ calls)."""
        flat = self.data.view(-1, self.num_kv_heads, self.head_dim)
        r = rows + 2 * layer * self.block_size
        flat.index_copy_(0, r, k.to(self.dtype))
        flat.index_copy_(0, r + self.block_size, v.to(self.dtype))

    def gather(self, layer: int, block_table: torch.Tensor,
               out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks in `block_table` ([..., nb]) -> [..., nb*block_size, kvh, hd].

        One index_select per K and V; the results are contiguous, so the reshape is free.
        `out`: two flat buffers of at least that many elements to gather into (reused
        across layers and steps instead of allocating ~MBs per call).
        """
        flat = block_table.reshape(-1)
        lead, nb = block_table.shape[:-1], block_table.shape[-1]
        shape = (*lead, nb * self.block_size, self.num_kv_heads, self.head_dim)
        if out is None:
            k = self.data[:, layer, 0].index_select(0, flat).view(shape)
            v = self.data[:, layer, 1].index_select(0, flat).view(shape)
            return k, v
        n = flat.numel() * self.block_size * self.num_kv_heads * self.head_dim
        rows = (flat.numel(), self.block_size, self.num_kv_heads, self.head_dim)
        kb, vb = out[0][:n].view(rows), out[1][:n].view(rows)
        torch.index_select(self.data[:, layer, 0], 0, flat, out=kb)
        torch.index_select(self.data[:, layer, 1], 0, flat, out=vb)
        return kb.view(shape), vb.view(shape)

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Block ``dst[i]`` becomes a copy of block ``src[i]`` (every layer, K and V)."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks for {len(dst)} destinations")
        for block in (*src, *dst):
            self._check_block(block)
        if src:
            index = torch.as_tensor(list(src), dtype=torch.long, device=self.data.device)
            self.data[torch.as_tensor(list(dst), dtype=torch.long,
                                      device=self.data.device)] = self.data[index]

    def zero_blocks(self, blocks: Sequence[int]) -> None:
        if blocks:
            self.data[torch.as_tensor(list(blocks), dtype=torch.long)] = 0
