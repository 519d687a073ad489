"""Byte pieces copied between two tensors in a few launches: how a GPU's KV moves on its host.

A KV move is many pieces at scattered offsets: one layer of a block (64 KiB for an 8B model)
or a whole block, each from one tensor (a worker's KV memory) to another (a same-host decode
worker's KV memory opened through CUDA IPC, or a store node's segment registered as pinned
memory: ``common/kv/cuda_ipc.py``, ``common/store/pinned.py``). A copy per piece costs a
launch each (a transfer-engine request: 6 us, issue 26), 8,192 of them for a 4k prompt of an
8B model sent layer by layer. Here both tensors are seen as rows of ``g`` bytes, ``g`` the
largest size dividing every offset, length and tensor size; a piece is a run of rows, and
one gather (``index_select``) and one scatter (``index_copy_``) move any number of pieces.
When the pieces coalesce into a few runs, a ``copy_`` per run moves them instead (on a GPU
host, the copy engine's DMA: 55 GB/s each way to pinned memory, issue 26).

Every piece is checked against both tensors on the host before anything is launched: an
index out of range inside a CUDA kernel would end the process's CUDA context, not raise.
The code is the same on any device (the CPU tests run it); on a GPU the caller picks the
stream and orders it against the compute (``side_stream_copy``).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from common.transfer import coalesce

# (source offset, destination offset, bytes), offsets from each tensor's first byte
Piece = tuple[int, int, int]

MAX_RUNS = 16  # at most this many runs after coalescing: a copy_ per run (DMA), no indices
MAX_TEMP_BYTES = 256 << 20  # the gather's temporary per launch pair


def check(pieces: Sequence[Piece], src_nbytes: int, dst_nbytes: int) -> None:
    """Every piece inside both tensors, or ``IndexError`` naming the first that is not."""
    for s, d, n in pieces:
        if n <= 0 or s < 0 or d < 0 or s + n > src_nbytes or d + n > dst_nbytes:
            raise IndexError(f"piece ({s}, {d}, {n}) is outside a {src_nbytes}-byte source "
                             f"or a {dst_nbytes}-byte destination")


def row_bytes(pieces: Sequence[Piece], src_nbytes: int, dst_nbytes: int) -> int:
    """The largest row size dividing every offset, length and both tensor sizes."""
    g = math.gcd(src_nbytes, dst_nbytes)
    for s, d, n in pieces:
        g = math.gcd(g, s, d, n)
    return g


def row_indices(pieces: Sequence[Piece], g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination row numbers (of ``g`` bytes) of every piece, in order."""
    starts = torch.tensor([(s // g, d // g, n // g) for s, d, n in pieces], dtype=torch.long)
    counts = starts[:, 2]
    first = torch.cumsum(counts, 0) - counts  # each piece's first position in the output
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(first, counts)
    return (torch.repeat_interleave(starts[:, 0], counts) + within,
            torch.repeat_interleave(starts[:, 1], counts) + within)


def copy_pieces(src: torch.Tensor, dst: torch.Tensor, pieces: Sequence[Piece],
                src_dma: Optional[torch.Tensor] = None,
                dst_dma: Optional[torch.Tensor] = None) -> int:
    """Copy every piece of flat uint8 ``src`` into flat uint8 ``dst`` on the current stream
    (asynchronous on a GPU: the caller synchronizes). ``src_dma``/``dst_dma``: the same
    bytes as a host tensor, for a per-run ``copy_`` (a pinned segment's CPU view, which the
    copy engine reads; its CUDA view is what kernels read). Returns the bytes copied."""
    check(pieces, src.numel(), dst.numel())
    if src.device != dst.device:
        raise ValueError(f"pieces from {src.device} to {dst.device}: one device only")
    if not pieces:
        return 0
    s0, d0, n0 = coalesce(*zip(*pieces))
    if len(n0) <= MAX_RUNS:
        a = src if src_dma is None else src_dma
        b = dst if dst_dma is None else dst_dma
        for s, d, n in zip(s0, d0, n0):
            b[d:d + n].copy_(a[s:s + n], non_blocking=True)
        return sum(n0)
    runs = list(zip(s0, d0, n0))
    g = row_bytes(runs, src.numel(), dst.numel())
    src_idx, dst_idx = row_indices(runs, g)
    rows_s, rows_d = src.view(-1, g), dst.view(-1, g)
    src_idx = src_idx.to(src.device, non_blocking=True)
    dst_idx = dst_idx.to(dst.device, non_blocking=True)
    step = max(1, MAX_TEMP_BYTES // g)
    for i in range(0, src_idx.numel(), step):
        rows_d.index_copy_(0, dst_idx[i:i + step], rows_s.index_select(0, src_idx[i:i + step]))
    return sum(n0)


def on_stream(stream: Optional["torch.cuda.Stream"], copy, after_compute: bool) -> int:
    """Run ``copy()`` (launches ``copy_pieces``) on ``stream`` and return once its copies are
    done, blocking this thread only (a lane's, never the compute thread). ``after_compute``:
    first wait for everything launched on the device's default stream so far (the compute
    that wrote the KV being sent). None: host memory, ``copy()`` is already synchronous."""
    if stream is None:
        return copy()
    with torch.cuda.stream(stream):
        if after_compute:
            stream.wait_stream(torch.cuda.default_stream(stream.device))
        nbytes = copy()
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    return nbytes
