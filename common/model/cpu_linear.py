"""Crescent's own CPU linears (csrc/linear_bf16.c, csrc/linear_f32.c): the weights packed
once in tiles of 64 outputs (``PackedLinear``), the sums in float32, each output row alone
(batch invariant by construction).

* bfloat16, on CPUs with AVX-512 BF16: a float32 model's linears in bfloat16 for a decode
  step's few rows, the activations rounded to bfloat16 (``linear_dtype``).
* float32, on CPUs with AVX-512: a float32 model's linears, any number of rows. At a
  decode step's few rows it reads the weights at twice oneDNN's rate; at a prompt's
  hundreds it computes as fast (SmolLM2's projections on one AMD EPYC core).

Where a kernel is not built (no compiler, not the instructions) or fails its check,
``kernel()`` is None and common/model/decoder.py ``Linear`` keeps oneDNN. A decode step
of SmolLM2 at batch 1-8 (one thread, AMD EPYC): see BENCHMARKS.md, "Engine"."""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F

from common.model import native

log = logging.getLogger(__name__)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
TILE = 64  # outputs a tile of the kernels: threads split the outputs in whole tiles
# The float32 kernel's threads split the rows too, in blocks of this many (whole row
# tiles of csrc/linear_f32.c): a decode step's rows are one block
ROW_BLOCK = 48
# the kernel of each dtype it multiplies in: its entry point, its integer arguments (m, n,
# k[, rows a unit], threads) and its check's tolerance against torch (float32 sums in
# another order)
_KERNELS = {torch.bfloat16: ("linear_bf16_par", 4, 1e-3),
            torch.float32: ("linear_f32_par", 5, 1e-4)}


class PackedLinear:
    """y = x W^T, ``weight`` [N, K] packed for the kernel of ``dtype``: bfloat16 as
    [N / 64, K / 2, 64, 2] (N a multiple of 16, K even), float32 as [N / 64, K, 64]; N
    padded to tiles of 64 with zero rows."""

    def __init__(self, fn: ctypes._CFuncPtr, weight: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16):
        n, k = weight.shape
        self.fn, self.dtype, self.out_features, self.in_features = fn, dtype, n, k
        tiles = -(-n // TILE)
        padded = torch.zeros(tiles * TILE, k, dtype=dtype)
        padded[:n] = weight
        if dtype is torch.bfloat16:  # output n's weights k and k + 1 side by side
            self.packed = padded.view(tiles, TILE, k // 2, 2).transpose(1, 2).contiguous()
        else:
            self.packed = padded.view(tiles, TILE, k).transpose(1, 2).contiguous()

    @staticmethod
    def fits(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> bool:
        if weight.dim() != 2:
            return False
        return dtype is torch.float32 or (weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] (any float dtype; rounded to the kernel's) → [M, N] float32."""
        x = x.to(self.dtype).contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        n, k = self.out_features, self.in_features
        if self.dtype is torch.float32:  # units of a tile by ROW_BLOCK rows
            self.fn(x.data_ptr(), self.packed.data_ptr(), y.data_ptr(), m, n, k, ROW_BLOCK,
                    native.threads(-(-n // TILE) * -(-m // ROW_BLOCK)))
        else:  # whole tiles a thread
            self.fn(x.data_ptr(), self.packed.data_ptr(), y.data_ptr(), m, n, k,
                    native.threads(-(-n // TILE)))
        return y


def kernel(dtype: torch.dtype = torch.bfloat16) -> Optional[ctypes._CFuncPtr]:
    """The entry point of the kernel that multiplies in ``dtype``; None where absent, or
    off (``CRESCENT_CPU_LINEAR=0``, read at each model load: benchmarks/decode_step.py
    compares them with oneDNN)."""
    if dtype not in _KERNELS or os.environ.get("CRESCENT_CPU_LINEAR", "1") == "0":
        return None
    return _checked(dtype)


@functools.cache
def _checked(dtype: torch.dtype) -> Optional[ctypes._CFuncPtr]:
    """The kernel's entry point, checked against torch on a small case (a partial tile)."""
    name, integers, tolerance = _KERNELS[dtype]
    lib = native.library()
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = [_P, _P, _P, *[_I64] * integers]
    fn.restype = None
    g = torch.Generator().manual_seed(0)
    w = torch.randn(80, 70, generator=g).to(dtype)
    x = torch.randn(7, 70, generator=g).to(dtype)
    got = PackedLinear(fn, w, dtype)(x)
    err = (got - F.linear(x.float(), w.float())).abs().max().item()
    if not err < tolerance:
        log.warning("the CPU %s linear differs from torch's by %.3g: oneDNN instead",
                    dtype, err)
        return None
    return fn
