"""bfloat16 linears for a decode step's few rows (csrc/linear_bf16.c), on CPUs with
AVX-512 BF16: the layer weights packed once in tiles of 64 outputs (``PackedLinear``),
the activations rounded to bfloat16, the sums in float32, each output row alone (batch
invariant by construction). Where the kernel is not built (no compiler, no AVX-512 BF16) or fails its
check, ``kernel()`` is None and common/model/decoder.py ``Linear`` keeps oneDNN. A decode
step of SmolLM2 at batch 1-8 (one thread, AMD EPYC): see BENCHMARKS.md, "Engine"."""
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
TILE = 64  # outputs a tile of the kernel: threads split the outputs in whole tiles


class PackedLinear:
    """y = x W^T, ``weight`` [N, K] (N a multiple of 16, K even) packed for the kernel:
    [N / 64, K / 2, 64, 2], N padded to tiles of 64 with zero rows."""

    def __init__(self, fn: ctypes._CFuncPtr, weight: torch.Tensor):
        n, k = weight.shape
        self.fn, self.out_features, self.in_features = fn, n, k
        tiles = -(-n // TILE)
        padded = torch.zeros(tiles * TILE, k, dtype=torch.bfloat16)
        padded[:n] = weight
        self.packed = padded.view(tiles, TILE, k // 2, 2).transpose(1, 2).contiguous()

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] (any float dtype; rounded to bfloat16) → [M, N] float32."""
        x = x.to(torch.bfloat16).contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        n, k = self.out_features, self.in_features
        self.fn(x.data_ptr(), self.packed.data_ptr(), y.data_ptr(), m, n, k,
                native.threads(-(-n // TILE)))  # whole tiles a thread
        return y


def kernel() -> Optional[ctypes._CFuncPtr]:
    """The kernel's entry point; None where absent, or off (``CRESCENT_CPU_LINEAR=0``,
    read at each model load: benchmarks/decode_step.py compares it with oneDNN)."""
    return None if os.environ.get("CRESCENT_CPU_LINEAR", "1") == "0" else _checked()


@functools.cache
def _checked() -> Optional[ctypes._CFuncPtr]:
    """The kernel's entry point, checked against torch on a small case."""
    lib = native.library()
    fn = getattr(lib, "linear_bf16_par", None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = [_P, _P, _P, _I64, _I64, _I64, _I64]
    fn.restype = None
    g = torch.Generator().manual_seed(0)
    w = torch.randn(80, 70, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 70, generator=g).to(torch.bfloat16)
    got = PackedLinear(fn, w)(x)
    err = (got - F.linear(x.float(), w.float())).abs().max().item()
    if not err < 1e-3:
        log.warning("the CPU bfloat16 linear differs from torch's by %.3g: oneDNN instead", err)
        return None
    return fn
