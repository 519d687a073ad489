"""Crescent's own CPU linears (csrc/linear_bf16.c, csrc/linear_f32.c): the weights packed
once in tiles of 64 outputs (``PackedLinear``), the sums in float32, each output row alone
(batch invariant by construction).

* bfloat16, on CPUs with AVX-512 BF16: a float32 model's linears in bfloat16 for a decode
  step's few rows, the activations rounded to bfloat16 (``linear_dtype``).
* float32, on CPUs with AVX-512: a float32 model's linears, any number of rows. At a
  decode step's few rows it reads the weights at twice oneDNN's rate; at a prompt's
  hundreds it computes as fast (SmolLM2's projections on one AMD EPYC core).
* quantized (csrc/linear_q.c, ``QuantLinear``), on CPUs with AVX-512: a GGUF's Q2_K ...
  Q8_0 linears kept as the file holds them (common/model/quant.py), their float32
  expansion made in registers: bit for bit the float32 kernel's result on the expanded
  weights, reading 0.75-1.25 bytes a weight instead of 4.
* int8 (csrc/linear_int8.c, ``QuantLinear`` of ``int8``), on CPUs with AVX-512 VNNI: the
  same codes times the inputs rounded to int8 per group (``linear_dtype = "int8"``),
  integer dot products; ``int8_reference`` is what it computes.

Where a kernel is not built (no compiler, not the instructions) or fails its check,
``kernel()`` is None and common/model/linear.py ``Linear`` keeps oneDNN. A decode step
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
from common.model.quant import QuantizedWeight

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


class QuantLinear:
    """y = x W^T, ``weight`` quantized (common/model/quant.py), packed for csrc/linear_q.c
    (float32 inputs) or, with ``int8``, for csrc/linear_int8.c (inputs rounded to int8).
    linear_q.c: codes as [N / 64, K, 64] bytes, or [N / 64, K, 32] of two nibbles
    (output j low, j + 32 high). linear_int8.c: codes as [N / 64, K / 4, 64, 4] bytes, or
    [N / 64, K / 4, 2, 64] of two nibbles (see its top). Both: scales and offsets as
    [N / 64, K / group, 2, 64] float32; N padded to tiles of 64 with zero rows (code,
    scale and offset 0)."""

    # rows a unit of a thread: a unit makes its tile's weights once (csrc/linear_q.c), so
    # more rows than the float32 kernel's ROW_BLOCK
    ROW_BLOCK = 96

    def __init__(self, fn: ctypes._CFuncPtr, weight: QuantizedWeight, int8: bool = False):
        n, k = weight.shape
        self.fn, self.out_features, self.in_features = fn, n, k
        self.bits, self.group, self.int8 = weight.bits, weight.group, int8
        self.dtype = torch.int8 if int8 else torch.float32  # what the inputs are made
        tiles = -(-n // TILE)
        codes = torch.zeros(tiles * TILE, k, dtype=torch.uint8)
        codes[:n] = weight.unpacked_codes()
        if int8:  # [tiles, quads, 64, 4]; 4 bits: outputs 16-31 of each half high
            codes = codes.view(tiles, TILE, k // 4, 4).transpose(1, 2)
            if self.bits == 4:
                halves = codes.reshape(tiles, k // 4, 2, 2, 16, 4)
                codes = halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)
        else:  # [tiles, k, 64]; 4 bits: outputs 32-63 high
            codes = codes.view(tiles, TILE, k).transpose(1, 2)
            if self.bits == 4:
                codes = codes[..., :TILE // 2] | (codes[..., TILE // 2:] << 4)
        self.codes = codes.contiguous()
        params = torch.zeros(2, tiles * TILE, k // self.group)
        params[0, :n], params[1, :n] = weight.scale, weight.offset
        self.params = params.view(2, tiles, TILE, -1).permute(1, 3, 0, 2).contiguous()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, float32 [len(ids), K], read back from the packed
        codes: what ``QuantizedWeight.dequantize`` gives, bit for bit (a tied LM head's
        codes serve the embedding lookup too, held once)."""
        k, tile, lane = self.in_features, ids // TILE, ids % TILE
        if self.int8:  # [tiles, K / 4, 64, 4]; 4 bits: [tiles, K / 4, 2, 16, 4] of two nibbles
            if self.bits == 8:
                codes = self.codes[tile, :, lane]
            else:
                half, nibble, low = lane // 32, lane % 32 // 16, lane % 16
                packed = self.codes[tile, :, half, low]
                codes = (packed >> (4 * nibble.view(-1, 1, 1))) & 0x0F
            codes = codes.reshape(len(ids), k)
        elif self.bits == 8:  # [tiles, K, 64]
            codes = self.codes[tile, :, lane]
        else:  # [tiles, K, 32]: outputs 32-63 high
            codes = (self.codes[tile, :, lane % 32] >> (4 * (lane // 32)).view(-1, 1)) & 0x0F
        params = self.params[tile, :, :, lane]  # [n, K / group, 2]
        scale, offset = (params[..., i].double().repeat_interleave(self.group, 1)
                         for i in (0, 1))
        return (codes.double() * scale + offset).float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] (any float dtype; made float32) → [M, N] float32."""
        x = x.to(torch.float32).contiguous()
        m, n, k = x.shape[0], self.out_features, self.in_features
        y = torch.empty(m, n, dtype=torch.float32)
        threads = native.threads(-(-n // TILE) * -(-m // self.ROW_BLOCK))
        if self.int8:  # scratch: the rounded inputs (int8), then their d and s (float32)
            rounded = -(-m * k // 64) * 64
            scratch = torch.empty(rounded + 8 * m * (k // self.group), dtype=torch.uint8)
            q = scratch.data_ptr()
            d = q + rounded
            self.fn(x.data_ptr(), q, d, d + 4 * m * (k // self.group), self.codes.data_ptr(),
                    self.params.data_ptr(), y.data_ptr(), m, n, k, self.group, self.bits,
                    self.ROW_BLOCK, threads)
        else:
            self.fn(x.data_ptr(), self.codes.data_ptr(), self.params.data_ptr(),
                    y.data_ptr(), m, n, k, self.group, self.bits, self.ROW_BLOCK, threads)
        return y


class ExpertLinears:
    """The quantized linears of a mixture's experts (common/model/moe.py), one shape and
    kind, in one call of csrc/parallel.c's ``linear_q_experts_par`` (or
    ``linear_int8_experts_par``): expert e multiplies rows [starts[e], starts[e + 1]) of
    its input, each row as its ``QuantLinear`` computes it alone, the units of all experts
    split over one team of threads (a step at batch 8 runs ~50 of 128 experts: as many
    calls of one or two rows, each forking the team, before)."""

    def __init__(self, fn: ctypes._CFuncPtr, linears: list[QuantLinear]):
        first = linears[0]
        self.fn, self.linears = fn, linears  # the linears hold the codes and params
        self.out_features, self.in_features = first.out_features, first.in_features
        self.group, self.bits, self.int8 = first.group, first.bits, first.int8
        self.codes = torch.tensor([lin.codes.data_ptr() for lin in linears], dtype=torch.int64)
        self.params = torch.tensor([lin.params.data_ptr() for lin in linears],
                                   dtype=torch.int64)

    @staticmethod
    def of(linears: list[Optional[QuantLinear | PackedLinear]]) -> Optional[ExpertLinears]:
        """The experts' linears in one call; None unless all are ``QuantLinear`` of one
        shape, group, width and kind, with the grouped entry point built."""
        if not linears or not all(isinstance(lin, QuantLinear) for lin in linears):
            return None
        shapes = {(lin.out_features, lin.in_features, lin.group, lin.bits, lin.int8)
                  for lin in linears}  # type: ignore[union-attr]
        fn = experts_kernel(linears[0].int8) if len(shapes) == 1 else None  # type: ignore[union-attr]
        return ExpertLinears(fn, linears) if fn is not None else None  # type: ignore[arg-type]

    def __call__(self, x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] float32, expert e's rows at [starts[e], starts[e + 1]) (``starts``
        int64 [experts + 1], starts[-1] = M) → [M, N] float32."""
        x = x.to(torch.float32).contiguous()
        m, n, k = x.shape[0], self.out_features, self.in_features
        y = torch.empty(m, n, dtype=torch.float32)
        experts = len(self.linears)
        threads = native.threads(-(-n // TILE) * max(1, experts))
        if self.int8:
            rounded = -(-m * k // 64) * 64
            scratch = torch.empty(rounded + 8 * m * (k // self.group), dtype=torch.uint8)
            q = scratch.data_ptr()
            d = q + rounded
            self.fn(x.data_ptr(), q, d, d + 4 * m * (k // self.group), starts.data_ptr(),
                    experts, self.codes.data_ptr(), self.params.data_ptr(), y.data_ptr(), n, k,
                    self.group, self.bits, QuantLinear.ROW_BLOCK, threads)
        else:
            self.fn(x.data_ptr(), starts.data_ptr(), experts, self.codes.data_ptr(),
                    self.params.data_ptr(), y.data_ptr(), n, k, self.group, self.bits,
                    QuantLinear.ROW_BLOCK, threads)
        return y


def experts_kernel(int8: bool = False) -> Optional[ctypes._CFuncPtr]:
    """csrc/parallel.c's grouped entry point over ``quant_kernel(int8)``'s kernel; None
    where that is absent or the grouped one fails its check."""
    return _checked_experts(int8) if quant_kernel(int8) is not None else None


@functools.cache
def _checked_experts(int8: bool) -> Optional[ctypes._CFuncPtr]:
    """The entry point, checked against each expert's own ``QuantLinear`` bit for bit
    (three experts, one of them given no rows, rows across row blocks)."""
    lib = native.library()
    name, pointers = ("linear_int8_experts_par", 5) if int8 else ("linear_q_experts_par", 2)
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = [*[_P] * pointers, _I64, _P, _P, _P, *[_I64] * 6]
    fn.restype = None
    g = torch.Generator().manual_seed(1)
    single = quant_kernel(int8)
    linears = [QuantLinear(single, QuantizedWeight(
        torch.randint(0, 256, (80, 48), generator=g, dtype=torch.uint8),
        torch.rand(80, 3, generator=g) / 64, torch.randn(80, 3, generator=g) / 8, 4), int8)
        for _ in range(3)]
    counts = [2, 0, QuantLinear.ROW_BLOCK + 5]
    x = torch.randn(sum(counts), 96, generator=g)
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)
    got = ExpertLinears(fn, linears)(x, starts)
    want = torch.cat([lin(x[a:b]) for lin, a, b in zip(linears, starts[:-1], starts[1:])])
    if not torch.equal(got, want):
        log.warning("the CPU grouped quantized linear (%s) differs from its experts' own: "
                    "not used", name)
        return None
    return fn


def int8_reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """What csrc/linear_int8.c computes, in float64 from the same rounded inputs (its
    only other rounding: float32 sums, in its order)."""
    m, k = x.shape
    n, group = weight.shape[0], weight.group
    xg = x.float().view(m, k // group, group)
    d = xg.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xg * inv[..., None]).double()
    codes = weight.unpacked_codes().double().view(n, k // group, group)
    sums = torch.einsum("mgi,ngi->mng", q, codes)
    return ((sums * weight.scale.double()[None] * d.double()[:, None]).sum(-1)
            + (weight.offset.double()[None] * xg.double().sum(-1)[:, None]).sum(-1))


def quant_kernel(int8: bool = False) -> Optional[ctypes._CFuncPtr]:
    """The quantized kernel's entry point: csrc/linear_q.c's (float32 inputs) or, with
    ``int8``, csrc/linear_int8.c's; None where absent (no compiler, no AVX-512, for int8
    no AVX-512 VNNI), off (``CRESCENT_CPU_LINEAR=0``) or failing its check: a quantized
    linear then takes the other kernel or is expanded to float (common/model/linear.py)."""
    if os.environ.get("CRESCENT_CPU_LINEAR", "1") == "0":
        return None
    return _checked_quant(int8)


@functools.cache
def _checked_quant(int8: bool) -> Optional[ctypes._CFuncPtr]:
    """The entry point, checked against torch (4- and 8-bit codes, groups of 16 and 32, a
    partial tile, a decode step's rows and a prompt's): on the expanded weights, or for
    int8 against ``int8_reference``."""
    lib = native.library()
    name, arguments = ("linear_int8_par", 7) if int8 else ("linear_q_par", 4)
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = [*[_P] * arguments, *[_I64] * 7]
    fn.restype = None
    g = torch.Generator().manual_seed(0)
    for bits, group in ((4, 32), (8, 16)):
        n, k = 80, 96
        weight = QuantizedWeight(
            torch.randint(0, 256, (n, k * bits // 8), generator=g, dtype=torch.uint8),
            torch.rand(n, k // group, generator=g) / 64,
            torch.randn(n, k // group, generator=g) / 8, bits)
        x = torch.randn(21, k, generator=g)
        for rows in (x[:3], x):
            got = QuantLinear(fn, weight, int8)(rows)
            want = (int8_reference(rows, weight).float() if int8
                    else F.linear(rows, weight.dequantize()))
            err = (got - want).abs().max().item()
            if not err < 1e-4:
                log.warning("the CPU quantized linear (%s) differs from torch's by %.3g: "
                            "not used", name, err)
                return None
    return fn


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
