"""One matmul of a layer, y = x @ weight.T (+ bias), on the fastest CPU kernel that runs
it (common/model/cpu_linear.py: Crescent's own float32, bfloat16, quantized and int8
kernels) or else oneDNN's packed weights, or ``F.linear`` (a GPU)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from common.model import cpu_linear
from common.model.quant import QuantizedWeight, is_quantized


class Linear:
    """y = x @ weight.T. On the CPU the weight is packed once, for Crescent's kernel (below)
    or else into oneDNN's blocked layout (the op inductor uses for frozen linears): for the
    small-M GEMMs of decode this is 1.4-3x faster than F.linear (MKL), which repacks the
    weight on every call; results differ only by float32 summation order. Elsewhere, or if
    packing fails its self-check, plain F.linear on the original tensor.

    ``dtype``: the dtype to multiply in, where it differs from the weight's: the weight is
    stored in it and each input cast to it and the output back (bfloat16 linears in a
    float32 model: half the weight bytes a decode step reads, packed for oneDNN's bfloat16
    kernels; decode 1.3-1.7x faster on an AVX-512 BF16 CPU).

    A row's result must not depend on the other rows (a greedy answer would change with
    the load): oneDNN and MKL compute one row by another path than several (on an AMD
    EPYC SmolLM2's 576 x 1536 down projections' single rows differed, for some inputs,
    from the same rows among 2 to 700, which all agreed), so on the CPU a single row is
    computed as two.

    On a CPU with AVX-512 both kinds run on Crescent's own kernels where they build
    (common/model/cpu_linear.py: each row alone, float32 out; a decode step's few rows
    read the weights once): float32 linears at any number of rows (oneDNN's float32 path
    read a decode step's weights at 10-14 GB/s where the core streams 21-26), bfloat16
    ones of a float32 model on a CPU with AVX-512 BF16 (oneDNN's small-M bfloat16 path
    read them at 7-8 GB/s where the core streams 18).

    A ``QuantizedWeight`` runs on a quantized kernel there: with ``dtype`` int8 its
    inputs rounded to int8 (csrc/linear_int8.c, where AVX-512 VNNI is), else float32
    ones (csrc/linear_q.c; it reads fewer bytes than bfloat16 and rounds nothing);
    elsewhere it is expanded to float32 first. A float weight with ``dtype`` int8
    multiplies in its own dtype.
    """

    BATCH_HINT = 32  # oneDNN picks its blocking for this M; any M works

    def __init__(self, weight: torch.Tensor | QuantizedWeight, pack: bool = True,
                 bias: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None,
                 native_only: bool = False):
        """``native_only``: multiply in ``dtype`` only on Crescent's kernel (float32 sums
        and outputs), else in the weight's own dtype (the lm_head: rounded logits
        change greedy answers)."""
        self.out_features, self.in_features = weight.shape
        self.native: Optional[cpu_linear.PackedLinear | cpu_linear.QuantLinear] = None
        int8, dtype = dtype is torch.int8, None if dtype is torch.int8 else dtype
        if is_quantized(weight):
            self.native = _quantized(weight, int8) if pack else None
            if self.native is not None:
                self.bias, self.cast, self.weight, self.packed = bias, None, None, None
                self.pad_single_row = False
                return
            weight = weight.dequantize()
        # Crescent's kernels, where they run: bfloat16 multiplies of a float32 (or other)
        # weight, and float32 ones of a float32 weight
        kind: Optional[torch.dtype] = None
        if pack and weight.device.type == "cpu":
            if dtype is torch.bfloat16 and weight.dtype != dtype:
                kind = torch.bfloat16
            elif weight.dtype is torch.float32 and dtype in (None, torch.float32):
                kind = torch.float32
        fn = (cpu_linear.kernel(kind) if kind is not None
              and cpu_linear.PackedLinear.fits(weight, kind) else None)
        if native_only and fn is None:
            dtype = None
        self.cast = dtype if dtype not in (None, weight.dtype) else None
        if self.cast is not None:
            weight = weight.to(self.cast)
            bias = None if bias is None else bias.to(self.cast)
        self.weight: Optional[torch.Tensor] = weight
        self.bias = bias
        self.packed: Optional[torch.Tensor] = None
        self.pad_single_row = weight.device.type == "cpu"
        if fn is not None:
            self.native, self.weight = cpu_linear.PackedLinear(fn, weight, kind), None
        elif pack and _can_pack(weight, self.cast is not None):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.BATCH_HINT)
                probe = torch.randn(9, self.in_features, generator=torch.Generator().manual_seed(0),
                                    dtype=weight.dtype)
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
                tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
                if torch.allclose(got, F.linear(probe, weight, bias), rtol=tol, atol=tol):
                    self.packed, self.weight = packed, None
            except (RuntimeError, AttributeError):  # op missing in this torch build
                pass

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            y = self.native(x)
            return (y if self.bias is None else y + self.bias).to(x.dtype)
        if self.cast is not None and x.dtype != self.cast:
            return self(x.to(self.cast)).to(x.dtype)
        if self.pad_single_row and x.dim() == 2 and x.shape[0] == 1:
            return self(x.expand(2, -1))[:1]
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias,
                                                      "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _quantized(weight: QuantizedWeight, int8: bool) -> Optional[cpu_linear.QuantLinear]:
    """``weight`` on the int8 kernel (``int8``, where it runs) or the float32-input one;
    None where neither runs."""
    for kind in (True, False) if int8 else (False,):
        fn = cpu_linear.quant_kernel(kind)
        if fn is not None:
            return cpu_linear.QuantLinear(fn, weight, kind)
    return None


def _can_pack(weight: torch.Tensor, cast: bool = False) -> bool:
    """float32 weights; bfloat16 ones cast from a float32 model (decode's small M: a
    bfloat16 model's prompt steps were no faster packed)."""
    packs = weight.dtype == torch.float32 or (cast and weight.dtype == torch.bfloat16)
    return (weight.device.type == "cpu" and packs and weight.dim() == 2
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
