"""The CPU's paged attention (csrc/paged_attention.c): each query row reads its
sequence's KV blocks in place, with no gather into a padded copy and no mask.

The C file is built with the other kernels at first use (common/model/native.py); a
call's rows split over torch's threads (csrc/parallel.c). Without a C compiler, or if the
library fails its check against torch's attention, ``kernel()`` is None and the engine
gathers as before (common/model/attention.py SdpaAttention).

Each row is computed by the same code in the same key order whatever else is in the call,
so a decode token's attention does not depend on the batch (tests/model/
test_cpu_attention.py).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Optional

import torch

from common.kv.memory import PagedKVMemory
from common.model import native

log = logging.getLogger(__name__)

DTYPES = {torch.float32: "paged_attention_f32", torch.bfloat16: "paged_attention_bf16"}
GATHERS = {torch.float32: "chunk_gather_f32", torch.bfloat16: "chunk_gather_bf16"}
ROWS_PER_THREAD = 8  # the least decode rows a thread takes
CHUNK_ROWS = 16  # a prompt chunk's rows go in tiles of 16 (csrc: ROWS), interleaved over threads

_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class _Layout(ctypes.Structure):
    """The C ``Layout``: where a layer's keys and values are and which rows read them."""
    _fields_ = [("tables", _P), ("table_width", _I64), ("rows", _P), ("lens", _P),
                ("hq", _I), ("hkv", _I), ("d", _I), ("bs", _I), ("block_stride", _I64),
                ("layer_off", _I64), ("v_off", _I64), ("token_stride", _I64),
                ("scale", ctypes.c_float), ("window", _I64)]


class PagedAttentionKernel:
    """The loaded library: ``attend`` (decode rows) and ``attend_chunk`` (a prompt chunk)
    run it over one layer of a ``PagedKVMemory``."""

    def __init__(self, lib: ctypes.CDLL, name: str = ""):
        self.name = name  # the library's file: its source, compiler and CPU flags
        self._fns, self._gathers = {}, {}
        for dtype, name in DTYPES.items():
            fn = getattr(lib, name + "_par")
            fn.argtypes = [ctypes.POINTER(_Layout), _P, _P, _I64, _P, _P, _I64, _I64]
            fn.restype = None
            self._fns[dtype] = fn
            gather = getattr(lib, GATHERS[dtype])
            gather.argtypes = [ctypes.POINTER(_Layout), _P, _I64, _I64, _P, _P]
            gather.restype = None
            self._gathers[dtype] = gather
        self._first_block = lib.chunk_first_block
        self._first_block.argtypes = [ctypes.POINTER(_Layout), _I64]
        self._first_block.restype = _I64
        self._chunk_rows = lib.chunk_rows_par
        self._chunk_rows.argtypes = [ctypes.POINTER(_Layout), _P, _P, _P, _I64, _I64, _P, _I64]
        self._chunk_rows.restype = None

    def supports(self, kv: PagedKVMemory) -> bool:
        return kv.data.device.type == "cpu" and kv.dtype in self._fns

    def supports_chunks(self, kv: PagedKVMemory) -> bool:
        """Prompt chunks: KV blocks of 16 tokens (a block's keys fill a vector's lanes),
        heads 64, 128 or 256 wide, or 576 (DeepSeek's latent and rotated key)."""
        return (self.supports(kv) and kv.block_size == 16
                and kv.head_dim in (64, 128, 256, 576))

    def attend_chunk(self, q: torch.Tensor, kv: PagedKVMemory, layer: int,
                     table: torch.Tensor, start: int, scale: float,
                     window: Optional[int] = None) -> torch.Tensor:
        """Attention of a prompt chunk's query rows ``q`` [T, heads, d] at positions
        [start, start + T) of the sequence whose blocks are ``table`` (at least
        ceil((start + T) / 16) of them), row t over keys [0, start + t], or of them the
        last ``window``: [T, heads, d] float32. Each row alone (csrc/paged_attention.c,
        chunk_rows)."""
        t, hq, d = q.shape
        end, data = start + t, kv.data
        q = q.to(torch.float32).contiguous()
        table = table.to(torch.int64).contiguous()
        layout = _Layout(table.data_ptr(), table.shape[-1], None, None, hq, kv.num_kv_heads,
                         d, kv.block_size, data.stride(0), layer * data.stride(1),
                         data.stride(2), data.stride(3), scale, window or 0)
        blocks = -(-end // 16) - self._first_block(ctypes.byref(layout), start)
        kt = torch.empty(blocks * kv.num_kv_heads * d * 16, dtype=torch.float32)
        vv = torch.empty_like(kt)
        self._gathers[kv.dtype](ctypes.byref(layout), data.data_ptr(), start, end,
                                kt.data_ptr(), vv.data_ptr())
        out = torch.empty_like(q)
        self._chunk_rows(ctypes.byref(layout), q.data_ptr(), kt.data_ptr(), vv.data_ptr(),
                         start, t, out.data_ptr(), native.threads(-(-t // CHUNK_ROWS)))
        return out

    def attend(self, q: torch.Tensor, kv: PagedKVMemory, layer: int, tables: torch.Tensor,
               rows: Optional[torch.Tensor], lens: torch.Tensor, scale: float,
               longest: Optional[int] = None, window: Optional[int] = None) -> torch.Tensor:
        """Attention of query rows ``q`` [T, heads, d] over keys [0, lens[t]) of block
        table row ``rows[t]`` (None: row t) of ``tables`` [R, width], or of them the last
        ``window`` (the blocks before it are not read): [T, heads, d] float32.
        ``longest``: max(lens), where the caller knows it. The caller keeps every table
        entry below ``kv``'s block count."""
        t, hq, d = q.shape
        data = kv.data
        q = q.to(torch.float32).contiguous()
        tables = tables.to(torch.int64).contiguous()
        lens = lens.to(torch.int32).contiguous()  # a decode step's kv_lens already are
        if rows is not None:
            rows = rows.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        layout = _Layout(tables.data_ptr(), tables.shape[1],
                         None if rows is None else rows.data_ptr(), lens.data_ptr(),
                         hq, kv.num_kv_heads, d, kv.block_size, data.stride(0),
                         layer * data.stride(1), data.stride(2), data.stride(3), scale,
                         window or 0)
        longest = int(lens.max()) if longest is None else longest
        threads = native.threads(t // ROWS_PER_THREAD)
        per_thread = hq * (-(-longest // 16) * 16 + d)  # a thread's scores (padded), sums
        scratch = torch.empty(threads * per_thread, dtype=torch.float32)
        self._fns[kv.dtype](ctypes.byref(layout), q.data_ptr(), data.data_ptr(), t,
                            out.data_ptr(), scratch.data_ptr(), per_thread, threads)
        return out


@functools.cache
def kernel() -> Optional[PagedAttentionKernel]:
    """The compiled kernel, built on first use; None where it cannot be (logged once)."""
    if os.environ.get("CRESCENT_CPU_ATTENTION", "1") == "0":
        return None
    lib = native.library()
    if lib is None:
        return None
    try:
        loaded = PagedAttentionKernel(lib, os.path.basename(lib._name))
        _self_check(loaded)
    except (AssertionError, AttributeError) as exc:
        log.warning("CPU paged attention unavailable (%s): decode gathers each sequence's "
                    "KV into a padded copy instead (slower)", exc)
        return None
    return loaded


def _self_check(k: PagedAttentionKernel) -> None:
    """The library against torch's attention on a small case of each KV dtype."""
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        kv = PagedKVMemory(6, 2, 4, 2, 8, dtype, torch.device("cpu"))
        kv.data.copy_(torch.randn(kv.data.shape, generator=g))
        q = torch.randn(2, 4, 8, generator=g)
        tables = torch.tensor([[3, 1, 4], [5, 0, 2]])
        lens = torch.tensor([9, 5])
        got = k.attend(q, kv, 1, tables, torch.arange(2), lens, 0.3)
        for t in range(2):
            keys, values = (x[:lens[t]].float().transpose(0, 1)[None] for x in
                            kv.gather(1, tables[t]))
            want = torch.nn.functional.scaled_dot_product_attention(
                q[t][None, :, None], keys, values, scale=0.3, enable_gqa=True)[0, :, 0]
            err = (got[t] - want).abs().max().item()
            assert err < 1e-4, f"differs from torch's attention by {err:.3g} ({dtype})"
