"""Linear weights kept block-quantized, as a GGUF holds them (Q2_K ... Q8_0), for the CPU
kernels of common/model/csrc/linear_q.c and linear_int8.c (``cpu_linear.QuantLinear``).

Every supported GGUF type is one form: w[n][k] = code * scale + offset, one (scale,
offset) for each ``group`` consecutive k of an output row (32, or 16 for Q2_K, Q3_K and
Q6_K), codes of 4 bits (Q4_0, Q4_1, Q4_K, and the 2- and 3-bit Q2_K, Q3_K) or 8 (Q8_0,
and the 5- and 6-bit Q5_0, Q5_1, Q5_K, Q6_K). The scales and offsets are what gguf's
dequantization multiplies and adds (Q4_K: d times a sub-block's scale, less dmin times
its min); each code times its scale is exact in float32, so the one rounding of the sum
gives gguf's float32 weights bit for bit (``dequantize``; the tests compare every type).
Other types (IQ*, the codebooks) are read as float32, as before.

A float checkpoint's linears can be quantized at load (``quantize``: gguf's own Q8_0 or
Q4_0 rounding, then the same form; ``quantize_matrices`` caches it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import xxhash

from common.model.loader import cache_dir, cached_shards, read_shards

_FORM_VERSION = 1  # of what ``quantize_matrices`` caches
# the cache's names of a quantized weight's parts (``flatten``, ``gather``)
_PARTS = (".q4codes", ".q8codes", ".qscale", ".qoffset")


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight: ``codes`` uint8 [N, K] (8 bits) or [N, K / 2] (4 bits: k even in
    the low nibble, k + 1 in the high), ``scale`` and ``offset`` float32 [N, K / group]."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.codes.shape
        return n, width * 8 // self.bits

    @property
    def group(self) -> int:
        return self.shape[1] // self.scale.shape[1]

    def unpacked_codes(self) -> torch.Tensor:
        """uint8 [N, K], one code a byte."""
        if self.bits == 8:
            return self.codes
        return torch.stack([self.codes & 0x0F, self.codes >> 4], dim=-1).reshape(self.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: code * scale + offset rounded once (the kernel's fused
        multiply-add; in float64 the product and the sum are exact)."""
        group = self.group
        codes = self.unpacked_codes().double()
        return (codes * self.scale.double().repeat_interleave(group, 1)
                + self.offset.double().repeat_interleave(group, 1)).float()

    def rows(self, index: Any) -> QuantizedWeight:
        """The rows ``index`` picks (a permutation, a slice)."""
        return QuantizedWeight(self.codes[index].contiguous(), self.scale[index].contiguous(),
                               self.offset[index].contiguous(), self.bits)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The rows of ``parts`` one after another (a layer's q/k/v in one matmul), in the
        widest codes and the smallest group of any part (a Q4_K_M file's Q6_K v beside
        Q4_K q and k)."""
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError("quantized weights of different widths")
        bits, group = max(p.bits for p in parts), min(p.group for p in parts)
        return QuantizedWeight(
            torch.cat([p.codes if p.bits == bits else p.unpacked_codes() for p in parts]),
            torch.cat([p.scale.repeat_interleave(p.group // group, 1) for p in parts]),
            torch.cat([p.offset.repeat_interleave(p.group // group, 1) for p in parts]), bits)

    def flatten(self, name: str) -> dict[str, torch.Tensor]:
        """Its parts as tensors named after ``name`` (a safetensors cache; ``gather``)."""
        return {f"{name}.q{self.bits}codes": self.codes, name + ".qscale": self.scale,
                name + ".qoffset": self.offset}


def gather(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``tensors`` with each ``flatten``ed weight put together again."""
    out: dict[str, Any] = {}
    for name, tensor in tensors.items():
        if not name.endswith(_PARTS):
            out[name] = tensor
        elif name.endswith("codes"):
            base, bits = name[:-len(".q4codes")], int(name[-len("4codes")])
            out[base] = QuantizedWeight(tensor, tensors[base + ".qscale"],
                                        tensors[base + ".qoffset"], bits)
    return out


def is_quantized(weight: Any) -> bool:
    return isinstance(weight, QuantizedWeight)


# ---- GGUF blocks -> the form ---------------------------------------------------------------

def _half(b: np.ndarray) -> np.ndarray:
    """A block's float16 field (two bytes) as float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, runs: int, width: int) -> np.ndarray:
    """``qs`` [..., runs * width] bytes as [..., runs, 2, width] codes: each run of
    ``width`` bytes gives ``width`` low nibbles, then ``width`` high ones."""
    q = qs.reshape(*qs.shape[:-1], runs, 1, width) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return q & np.uint8(0x0F)


def _bits_of(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of a little-endian bit field ``qh`` [..., count / 8] as [..., count]."""
    return np.unpackbits(qh, axis=-1, count=count, bitorder="little")


def _q4_0(b: np.ndarray) -> tuple:
    d = _half(b[..., 0:2])
    return _nibbles(b[..., 2:18], 1, 16).reshape(*b.shape[:-1], 32), d, -8 * d


def _q4_1(b: np.ndarray) -> tuple:
    return _nibbles(b[..., 4:20], 1, 16).reshape(*b.shape[:-1], 32), _half(b[..., 0:2]), \
        _half(b[..., 2:4])


def _q5(b: np.ndarray, start: int) -> np.ndarray:
    low = _nibbles(b[..., start + 4:start + 20], 1, 16).reshape(*b.shape[:-1], 32)
    return low | (_bits_of(b[..., start:start + 4], 32) << 4)


def _q5_0(b: np.ndarray) -> tuple:
    d = _half(b[..., 0:2])
    return _q5(b, 2), d, -16 * d


def _q5_1(b: np.ndarray) -> tuple:
    return _q5(b, 4), _half(b[..., 0:2]), _half(b[..., 2:4])


def _q8_0(b: np.ndarray) -> tuple:
    d = _half(b[..., 0:2])
    codes = (np.ascontiguousarray(b[..., 2:34]).view(np.int8).astype(np.int16) + 128)
    return codes.astype(np.uint8), d, -128 * d


def _k_scales(b: np.ndarray) -> tuple:
    """A Q4_K / Q5_K super-block's 8 sub-blocks' scales and offsets."""
    from gguf.quants import Q4_K

    lead = b.shape[:-1]
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
    scale = _half(b[..., 0:2]) * sc.reshape(*lead, 8).astype(np.float32)
    return scale, -(_half(b[..., 2:4]) * mn.reshape(*lead, 8).astype(np.float32))


def _q4_k(b: np.ndarray) -> tuple:
    scale, offset = _k_scales(b)
    return _nibbles(b[..., 16:144], 4, 32).reshape(*b.shape[:-1], 256), scale, offset


def _q5_k(b: np.ndarray) -> tuple:
    scale, offset = _k_scales(b)
    low = _nibbles(b[..., 48:176], 4, 32).reshape(*b.shape[:-1], 8, 32)
    high = _bits_of(b[..., 16:48, None], 8).swapaxes(-1, -2)  # bit j of byte i: sub-block j
    return (low | (high << 4)).reshape(*b.shape[:-1], 256), scale, offset


def _q6_k(b: np.ndarray) -> tuple:
    lead = b.shape[:-1]
    low = _nibbles(b[..., 0:128], 2, 64).reshape(*lead, 8, 32)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    codes = (low | ((qh & np.uint8(3)).reshape(*lead, 8, 32) << 4)).reshape(*lead, 256)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    scale = _half(b[..., 208:210]) * sc
    return codes, scale, -32 * scale


_CRUMBS = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)  # 2-bit fields of a byte


def _q2_k(b: np.ndarray) -> tuple:
    lead, sc = b.shape[:-1], b[..., 0:16]
    codes = ((b[..., 16:80].reshape(*lead, 2, 1, 32) >> _CRUMBS) & np.uint8(3))
    scale = _half(b[..., 80:82]) * (sc & np.uint8(0x0F)).astype(np.float32)
    offset = -(_half(b[..., 82:84]) * (sc >> 4).astype(np.float32))
    return codes.reshape(*lead, 256), scale, offset


def _q3_k(b: np.ndarray) -> tuple:
    """Q3_K's q = low 2 bits - 4 where the high bit is clear: code = low | high << 2."""
    lead, scales = b.shape[:-1], b[..., 96:108]
    low = (b[..., 32:96].reshape(*lead, 2, 1, 32) >> _CRUMBS) & np.uint8(3)
    high = _bits_of(b[..., 0:32, None], 8).swapaxes(-1, -2)  # bit j of byte i: row j
    sc_low = scales[..., 0:8].reshape(*lead, 1, 8) >> np.array([0, 4], np.uint8).reshape(2, 1)
    sc_high = scales[..., 8:12].reshape(*lead, 1, 4) >> _CRUMBS
    sc = ((sc_low.reshape(*lead, 16) & np.uint8(0x0F))
          | ((sc_high.reshape(*lead, 16) & np.uint8(3)) << 4)).astype(np.int8) - np.int8(32)
    scale = _half(b[..., 108:110]) * sc.astype(np.float32)
    codes = low.reshape(*lead, 256) | (high.reshape(*lead, 256) << 2)
    return codes, scale, -4 * scale


# GGML type name -> (how its blocks unpack, code bits, elements a (scale, offset))
_GGUF_TYPES = {"Q4_0": (_q4_0, 4, 32), "Q4_1": (_q4_1, 4, 32), "Q5_0": (_q5_0, 8, 32),
               "Q5_1": (_q5_1, 8, 32), "Q8_0": (_q8_0, 8, 32), "Q4_K": (_q4_k, 4, 32),
               "Q5_K": (_q5_k, 8, 32), "Q6_K": (_q6_k, 8, 16), "Q2_K": (_q2_k, 4, 16),
               "Q3_K": (_q3_k, 4, 16)}


def from_gguf(data: np.ndarray, type_name: str,
              shape: tuple[int, int]) -> Optional[QuantizedWeight]:
    """A GGUF tensor's raw blocks (``data``, uint8, as gguf's reader holds them) of an
    [N, K] weight in the form; None for a type it does not take."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    if type_name not in _GGUF_TYPES:
        return None
    unpack, bits, group = _GGUF_TYPES[type_name]
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    n, k = shape
    codes, scale, offset = unpack(np.asarray(data, np.uint8).reshape(n, k // block, size))
    codes = torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k)))
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)

    def per_group(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, np.float32).reshape(n, k // group))

    return QuantizedWeight(codes.contiguous(), per_group(scale), per_group(offset), bits)


def quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    """A float [N, K] weight rounded as llama.cpp's ``kind`` ("q8_0", "q4_0") rounds it
    (gguf's quantize), in the form."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    type_name = kind.upper()
    data = gguf_quantize(weight.detach().float().numpy(), GGMLQuantizationType[type_name])
    quantized = from_gguf(data, type_name, tuple(weight.shape))
    assert quantized is not None
    return quantized


def quantize_matrices(weights: dict[str, Any], kind: str, layers: range,
                      identity: str = "") -> dict[str, Any]:
    """``weights`` with every matrix a pipeline stage of ``layers`` reads (its layers'
    linears, the embeddings, the LM head) quantized as ``kind`` (``quantize``), as
    llama.cpp's quantize does with ``--pure``; the rest as it is. Where the checkpoint
    has an ``identity`` (``ModelConfig.weights_id``) the result is cached (the rounding
    takes ~15 s a billion parameters: every worker's start would pay it), keyed by it,
    ``kind`` and ``layers``."""
    def ours(name: str, w: Any) -> bool:
        if len(w.shape) != 2 or is_quantized(w) or w.shape[1] % 32:
            return False  # a row not whole blocks stays float, as llama.cpp keeps it
        if name.endswith("gate.weight"):
            return False  # a mixture's router (and shared expert gate), as llama.cpp's
        return not name.startswith("model.layers.") or int(name.split(".")[2]) in layers

    made = ((name, quantize(w, kind)) for name, w in weights.items() if ours(name, w))
    if not identity:
        return {**weights, **dict(made)}

    key = xxhash.xxh3_64(f"{identity}|{kind}|{layers.start}-{layers.stop}|{_FORM_VERSION}".encode())
    base = os.path.join(cache_dir(), f"{kind}-{key.hexdigest()}")
    quantized = read_shards(base) if os.path.isdir(base) else cached_shards(base, made)[0]
    return {**weights, **quantized}
