"""Byte pieces copied between two tensors in a few launches: how a GPU's KV moves on its host.

A KV move is many pieces at scattered offsets: one layer of a block (64 KiB for an 8B model)
or a whole block, each from one tensor (a worker's KV memory) to another (a same-host decode
worker's KV memory opened through CUDA IPC, or a store node's segment registered as pinned
memory: ``common/kv/cuda_ipc.py``, ``common/store/pinned.py``). A copy per piece costs a
launch each (a transfer-engine request: 6 us, issue 26), 8,192 of them for a 4k prompt of an
8B model sent layer by layer. Here both tensors are seen as rows of ``g`` bytes; a piece is a
run of rows, and one gather (``index_select``) and one scatter (``index_copy_``) move any
number of pieces (``copy_rows``). When the pieces coalesce into a few runs, a ``copy_`` per
run moves them instead (on a GPU host, the copy engine's DMA to and from pinned memory).

Everything per piece is vectorized (numpy on the host, index tensors on the device): on a GPU
the Python around a layer's copy, not the copy, is what a layer-wise prefill pays (its first
version, a loop per piece, kept the lanes ~0.4 ms a layer behind the compute). Every piece
is checked against both tensors on the host before anything is launched: an index out of
range inside a CUDA kernel would end the process's CUDA context, not raise. The code is the
same on any device (the CPU tests run it); on a GPU the caller picks the stream and orders it
against the compute (``on_stream``).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

import numpy as np
import torch

# (source offset, destination offset, bytes), offsets from each tensor's first byte
Piece = tuple[int, int, int]

T = TypeVar("T")

MAX_RUNS = 16  # at most this many runs after coalescing: a copy_ per run (DMA), no indices
# ... or this many where every run is this long (whole blocks of an 8B model are 2 MiB): the
# copy engine moves them without taking SMs from the compute they overlap
MAX_DMA_RUNS, DMA_RUN_BYTES = 4096, 256 << 10
MAX_TEMP_BYTES = 256 << 20  # the gather's temporary per launch pair


def as_arrays(pieces: Sequence[Piece]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
    return a[:, 0], a[:, 1], a[:, 2]


def check(s: np.ndarray, d: np.ndarray, n: np.ndarray, src_nbytes: int,
          dst_nbytes: int) -> None:
    """Every piece inside both tensors, or ``IndexError`` naming the first that is not."""
    bad = (n <= 0) | (s < 0) | (d < 0) | (s + n > src_nbytes) | (d + n > dst_nbytes)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise IndexError(f"piece ({s[i]}, {d[i]}, {n[i]}) is outside a {src_nbytes}-byte "
                         f"source or a {dst_nbytes}-byte destination")


def coalesce(s: np.ndarray, d: np.ndarray, n: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge each piece that continues the previous one on both sides."""
    if len(n) < 2:
        return s, d, n
    joins = (s[:-1] + n[:-1] == s[1:]) & (d[:-1] + n[:-1] == d[1:])
    first = np.flatnonzero(np.concatenate(([True], ~joins)))
    return s[first], d[first], np.add.reduceat(n, first)


def row_bytes(s: np.ndarray, d: np.ndarray, n: np.ndarray, src_nbytes: int,
              dst_nbytes: int) -> int:
    """The largest row size dividing every offset, length and both tensor sizes."""
    return int(np.gcd.reduce(np.concatenate((s, d, n, [src_nbytes, dst_nbytes]))))


def row_indices(s: np.ndarray, d: np.ndarray, n: np.ndarray, g: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination row numbers (of ``g`` bytes) of every piece, in order."""
    counts = n // g
    first = np.cumsum(counts) - counts  # each piece's first position in the output
    within = np.arange(int(counts.sum())) - np.repeat(first, counts)
    return (torch.from_numpy(np.repeat(s // g, counts) + within),
            torch.from_numpy(np.repeat(d // g, counts) + within))


def rows_view(flat: torch.Tensor, row_nbytes: int) -> torch.Tensor:
    """Flat uint8 ``flat`` as rows of ``row_nbytes``, in 8-byte words where they divide
    it: a gather of bytes reads pinned host memory one byte per load (12-13 GB/s on an
    H200 for 64 KiB rows, issue 26's second run), a gather of words eight at a time."""
    if row_nbytes % 8 == 0 and flat.numel() % 8 == 0 and flat.data_ptr() % 8 == 0:
        return flat.view(torch.int64).view(-1, row_nbytes // 8)
    return flat.view(-1, row_nbytes)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor,
              dst_idx: torch.Tensor) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for 2-D row views on one device, indices on it
    too (checked by the caller): a gather and a scatter per ``MAX_TEMP_BYTES`` of rows."""
    step = max(1, MAX_TEMP_BYTES // (src.shape[1] * src.element_size()))
    for i in range(0, src_idx.numel(), step):
        dst.index_copy_(0, dst_idx[i:i + step], src.index_select(0, src_idx[i:i + step]))


def copy_pieces(src: torch.Tensor, dst: torch.Tensor, pieces: Sequence[Piece],
                src_dma: Optional[torch.Tensor] = None,
                dst_dma: Optional[torch.Tensor] = None) -> int:
    """Copy every piece of flat uint8 ``src`` into flat uint8 ``dst`` on the current stream
    (asynchronous on a GPU: the caller synchronizes). ``src_dma``/``dst_dma``: the same
    bytes as a host tensor, for a per-run ``copy_`` (a pinned segment's CPU view, which the
    copy engine reads; its CUDA view is what kernels read). Returns the bytes copied."""
    if src.device != dst.device:
        raise ValueError(f"pieces from {src.device} to {dst.device}: one device only")
    if not pieces:
        return 0
    s, d, n = as_arrays(pieces)
    check(s, d, n, src.numel(), dst.numel())
    s, d, n = coalesce(s, d, n)
    if len(n) <= MAX_RUNS or (len(n) <= MAX_DMA_RUNS and int(n.min()) >= DMA_RUN_BYTES):
        a = src if src_dma is None else src_dma
        b = dst if dst_dma is None else dst_dma
        for x, y, k in zip(s.tolist(), d.tolist(), n.tolist()):
            b[y:y + k].copy_(a[x:x + k], non_blocking=True)
        return int(n.sum())
    g = row_bytes(s, d, n, src.numel(), dst.numel())
    src_idx, dst_idx = row_indices(s, d, n, g)
    copy_rows(rows_view(src, g), rows_view(dst, g), src_idx.to(src.device, non_blocking=True),
              dst_idx.to(dst.device, non_blocking=True))
    return int(n.sum())


def launch(stream: Optional["torch.cuda.Stream"], copy: Callable[[], T],
           after: bool = True) -> tuple[T, Optional["torch.cuda.Event"]]:
    """Run ``copy()`` (it launches copies) on ``stream``, behind the work launched so far on
    this thread's current stream when ``after`` (in the compute thread: the compute that
    wrote the KV being sent; in a lane: the default stream, the same compute). Returns what
    ``copy()`` returned and the event that fires once its copies are done; no event for
    host memory (``stream`` None), whose ``copy()`` is synchronous."""
    if stream is None:
        return copy(), None
    if after:
        ready = torch.cuda.Event()
        ready.record()
        stream.wait_event(ready)
    with torch.cuda.stream(stream):
        out = copy()
        done = torch.cuda.Event()
        done.record(stream)
    return out, done


def on_stream(stream: Optional["torch.cuda.Stream"], copy: Callable[[], int],
              after_compute: bool) -> int:
    """``launch``, then wait until its copies are done, blocking this thread only (a lane's,
    never the compute thread)."""
    nbytes, done = launch(stream, copy, after_compute)
    if done is not None:
        done.synchronize()
    return nbytes
