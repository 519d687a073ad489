"""Triton kernels of the GPU engine: paged decode attention that reads each sequence's K/V
blocks where they are, and the fused elementwise steps around the matmuls of a layer.

On a GPU the eager decode step launched ~1,180 kernels (the per-layer K/V gather into
padded tensors alone was 22 % of its GPU time at batch 32); with these a layer is ten
launches, and a CUDA graph (common/engine/cuda_graphs.py) replays them all at once.

- ``paged_decode_attention``: one query token per sequence over its K/V in the paged
  memory (common/kv/memory.py's layout), split-KV: a program takes one sequence, one KV
  head (its group of query heads together, so each K/V byte is read once) and one slice of
  the context; where a context has several slices (small batches), a second kernel merges
  them by their log-sum-exps. The kernel reads
  each sequence's length from device memory, so one launch (and one graph) serves any
  lengths; a length of 0 (a padded row) gives zeros.
- ``write_kv``: the step's new K/V rows into the paged memory; a row of -1 (a padded
  batch row) is skipped.
- ``rms_norm``, ``add_rms_norm`` (the residual add and the next norm in one pass),
  ``rope_qk_`` (rotary embedding of q and k in place in the QKV product, cos/sin from the
  positions), ``silu_mul``.

Everything runs in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``), which is how
the tests compare it with the torch path without a GPU. ``available()`` is False where the
triton package is missing; the engine then keeps the torch path.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the torch path serves
    triton = None
    tl = None


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None


def usable_on(device: torch.device) -> bool:
    """Whether these kernels run on ``device``: a CUDA GPU, or any tensor under the
    interpreter (tests)."""
    if triton is None:
        return False
    return device.type == "cuda" or _INTERPRET


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _precision(dtype: torch.dtype) -> str:
    # float32 products stay float32 (Triton's default for them is TF32: the CUDA path
    # must agree with the CPU to 1e-4 in float32)
    return "ieee" if dtype == torch.float32 else "tf32"


if triton is not None:

    @triton.jit
    def _decode_tile(q, base, table, start, hi, m, total, acc, stride_kb, stride_kt, v_offset,
                     scale, d, d_ok, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                     PRECISION: tl.constexpr):
        """One tile of keys [start, start + BLOCK_N) (those below ``hi``) folded into the
        running max ``m``, sum ``total`` and output ``acc`` (online softmax)."""
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < hi
        block = tl.load(table + t // PAGE, mask=t_ok, other=0).to(tl.int64)
        rows = block * stride_kb + (t % PAGE) * stride_kt
        ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(base + rows[:, None] + d[None, :], mask=ok, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(base + v_offset + rows[:, None] + d[None, :], mask=ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=PRECISION)
        return m_new, total * alpha + tl.sum(p, 1), acc

    @triton.jit
    def _decode_split_kernel(Q, KV, Tables, Lens, Out, Lse,
                             stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, v_offset,
                             stride_tb, stride_ob, stride_oh, stride_os, scale,
                             GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                             BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                             SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                             STRIDE_IN_MEMORY: tl.constexpr, INTERPRET: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        n = tl.load(Lens + b).to(tl.int32)
        per = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N  # tiles never straddle slices
        lo = split * per
        hi = tl.minimum(lo + per, n)
        hs = tl.arange(0, BLOCK_H)
        head_ok = hs < GROUP
        heads = kvh * GROUP + hs
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(Q + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=head_ok[:, None] & d_ok[None, :], other=0.0)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        if STRIDE_IN_MEMORY:
            stride_tb = tl.load(stride_tb)
        table = Tables + b.to(tl.int64) * stride_tb
        base = KV + kvh * stride_kh
        if INTERPRET:  # the interpreter cannot take a range over loaded values
            start = lo
            while start < hi:
                m, total, acc = _decode_tile(q, base, table, start, hi, m, total, acc,
                                             stride_kb, stride_kt, v_offset, scale, d, d_ok,
                                             PAGE, BLOCK_N, PRECISION)
                start += BLOCK_N
        else:
            for start in range(lo, hi, BLOCK_N):
                m, total, acc = _decode_tile(q, base, table, start, hi, m, total, acc,
                                             stride_kb, stride_kt, v_offset, scale, d, d_ok,
                                             PAGE, BLOCK_N, PRECISION)
        some = hi > lo
        out = acc / tl.where(some, total, 1.0)[:, None]
        where = Out + b.to(tl.int64) * stride_ob + heads * stride_oh + split * stride_os
        ok = head_ok[:, None] & d_ok[None, :]
        if SPLITS == 1:  # the whole context: the output itself, no merge
            tl.store(where[:, None] + d[None, :], out.to(Out.dtype.element_ty), mask=ok)
        else:
            tl.store(where[:, None] + d[None, :], out, mask=ok)
            lse = tl.where(some, m + tl.log(tl.where(some, total, 1.0)), float("-inf"))
            tl.store(Lse + (b * GROUP * tl.num_programs(1) + heads) * SPLITS + split, lse,
                     mask=head_ok)

    @triton.jit
    def _decode_merge_kernel(Out, Lse, O, stride_ob, stride_oh, stride_os, stride_o,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
                             BLOCK_S: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        s = tl.arange(0, BLOCK_S)
        s_ok = s < SPLITS
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        lse = tl.load(Lse + (b * heads + h) * SPLITS + s, mask=s_ok, other=float("-inf"))
        top = tl.max(lse, 0)
        live = top > float("-inf")  # a sequence of length 0 (a padded row): zeros
        w = tl.where(s_ok, tl.exp(lse - tl.where(live, top, 0.0)), 0.0)
        w = tl.where(live, w, 0.0)
        part = tl.load(Out + b.to(tl.int64) * stride_ob + h * stride_oh + s[:, None] * stride_os
                       + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        o = tl.sum(part * w[:, None], 0) / tl.where(live, tl.sum(w, 0), 1.0)
        tl.store(O + b.to(tl.int64) * stride_o + h * D + d, o.to(O.dtype.element_ty), mask=d_ok)

    @triton.jit
    def _write_kv_kernel(K, V, Rows, Flat, stride_k, stride_v, v_offset, layer_offset,
                         WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        row = tl.load(Rows + t)
        if row >= 0:
            i = tl.arange(0, BLOCK)
            ok = i < WIDTH
            dst = Flat + (row + layer_offset) * WIDTH + i
            k = tl.load(K + t.to(tl.int64) * stride_k + i, mask=ok)
            v = tl.load(V + t.to(tl.int64) * stride_v + i, mask=ok)
            tl.store(dst, k.to(Flat.dtype.element_ty), mask=ok)
            tl.store(dst + v_offset, v.to(Flat.dtype.element_ty), mask=ok)

    @triton.jit
    def _rms_norm_kernel(X, Delta, W, H, Y, stride_x, stride_d, eps, N: tl.constexpr,
                         BLOCK: tl.constexpr, ADD: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        ok = i < N
        x = tl.load(X + r * stride_x + i, mask=ok, other=0.0)
        if ADD:  # the residual add first, rounded to the model's dtype as torch does
            x = (x.to(tl.float32) + tl.load(Delta + r * stride_d + i, mask=ok,
                                            other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(H + r * N + i, x, mask=ok)
        xf = x.to(tl.float32)
        normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)).to(x.dtype)
        w = tl.load(W + i, mask=ok, other=0.0)
        tl.store(Y + r * N + i, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=ok)

    @triton.jit
    def _rope_kernel(X, Positions, InvFreq, stride_t, HALF: tl.constexpr,
                     BLOCK: tl.constexpr):
        t = tl.program_id(0)
        head = tl.program_id(1)
        i = tl.arange(0, BLOCK)
        ok = i < HALF
        pos = tl.load(Positions + t).to(tl.float32)
        angle = pos * tl.load(InvFreq + i, mask=ok, other=0.0)
        cos, sin = tl.cos(angle), tl.sin(angle)
        base = X + t.to(tl.int64) * stride_t + head * 2 * HALF
        a = tl.load(base + i, mask=ok).to(tl.float32)
        b = tl.load(base + HALF + i, mask=ok).to(tl.float32)
        tl.store(base + i, (a * cos - b * sin).to(X.dtype.element_ty), mask=ok)
        tl.store(base + HALF + i, (b * cos + a * sin).to(X.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(X, Y, stride_x, N: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < N
        gate = tl.load(X + r * stride_x + c, mask=ok).to(tl.float32)
        up = tl.load(X + r * stride_x + N + c, mask=ok).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(Y + r * N + c, out.to(Y.dtype.element_ty), mask=ok)


# The decode kernel's launch: keys a tile (one page of 16), warps, pipeline stages, and
# contexts split until a step has about PROGRAMS_PER_SM programs an SM. On an H100 at 128
# sequences of 1k tokens (benchmarks/gpu.py --sweep, BENCHMARKS.md) this read 2.43 TB/s,
# one slice a context; 2.2 at 2 to 4 slices, 2.0-2.3 at tiles of 32 or 64 keys.
BLOCK_N, NUM_WARPS, NUM_STAGES = 16, 2, 3
MAX_SPLITS = 32
PROGRAMS_PER_SM = 4


def decode_splits(batch: int, kv_heads: int, programs: int) -> int:
    """Slices of the context per (sequence, KV head): enough programs to keep the GPU's
    memory busy (``programs``) when the batch alone does not."""
    return max(1, min(MAX_SPLITS, math.ceil(programs / max(1, batch * kv_heads))))


@functools.lru_cache(maxsize=None)
def target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def paged_decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor,
                           lens: torch.Tensor, splits: Optional[int] = None,
                           table_stride: Optional[torch.Tensor] = None, block_n: int = BLOCK_N,
                           num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                           scale: Optional[float] = None) -> torch.Tensor:
    """Attention of one new token per sequence: ``q`` [B, heads, head_dim] (rows may be
    strided) over the first ``lens[b]`` tokens of sequence b, whose blocks are
    ``tables[b]`` in ``kv_layer`` = PagedKVMemory.layer_view(layer) ([blocks, 2, page,
    kv_heads, head_dim], any strides with head_dim contiguous). Returns [B, heads *
    head_dim] in q's dtype. ``splits``: slices of each context (None: enough to fill the
    GPU at this batch size). ``table_stride``: a device scalar giving the distance between
    rows of ``tables`` (then flat), read by the kernel: a CUDA graph's tables change width
    from step to step. ``block_n``, ``num_warps``, ``num_stages``: the split kernel's
    tile of keys and launch shape (benchmarks/gpu.py compares a few). ``scale``: of the
    scores (None: head_dim ** -0.5)."""
    batch, heads, dim = q.shape
    _, two, page, kv_heads, kd = kv_layer.shape
    assert two == 2 and kd == dim and heads % kv_heads == 0 and q.stride(2) == 1
    assert kv_layer.stride(4) == 1 and tables.stride(-1) == 1
    group = heads // kv_heads
    if splits is None:
        splits = decode_splits(batch, kv_heads, target_programs(q.device))
    out = torch.empty(batch, heads * dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if splits == 1:  # the split kernel writes ``out`` ([B, heads, 1 split, dim])
        parts, lse = out.view(batch, heads, 1, dim), out
    else:
        parts = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    block_d = _pow2(dim)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, kv_layer, tables, lens, parts, lse,
        q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(2), kv_layer.stride(3),
        kv_layer.stride(1), tables.stride(0) if table_stride is None else table_stride,
        parts.stride(0), parts.stride(1),
        parts.stride(2), 1.0 / math.sqrt(dim) if scale is None else scale,
        GROUP=group, BLOCK_H=max(16, _pow2(group)), D=dim, BLOCK_D=block_d, PAGE=page,
        BLOCK_N=block_n, SPLITS=splits, PRECISION=_precision(q.dtype),
        STRIDE_IN_MEMORY=table_stride is not None, INTERPRET=_INTERPRET, num_warps=num_warps,
        num_stages=num_stages)
    if splits == 1:
        return out
    _decode_merge_kernel[(batch, heads)](
        parts, lse, out, parts.stride(0), parts.stride(1), parts.stride(2), out.stride(0),
        D=dim, BLOCK_D=block_d, SPLITS=splits, BLOCK_S=max(2, _pow2(splits)), num_warps=1)
    return out


def write_kv(data: torch.Tensor, layer: int, rows: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """PagedKVMemory.write_rows in one launch: token t's k/v [kv_heads, head_dim] go to
    layer ``layer`` at ``rows[t]`` (PagedKVMemory.token_rows); rows of -1 are skipped."""
    nb, layers, _, page, kv_heads, dim = data.shape
    width = kv_heads * dim
    assert k.stride(2) == 1 and v.stride(2) == 1 and k.stride(1) == dim == v.stride(1)
    if rows.numel() == 0:
        return
    _write_kv_kernel[(rows.numel(),)](
        k, v, rows, data, k.stride(0), v.stride(0), page * width, 2 * layer * page,
        WIDTH=width, BLOCK=_pow2(width), num_warps=4)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """common/model/decoder.py's rms_norm in one launch."""
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)) in one launch, both new tensors."""
    return _norm(h, delta, weight, eps)


def _norm(x: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x.shape
    assert x.stride(1) == 1 and (delta is None or delta.stride(1) == 1)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if delta is not None else x
    if rows:
        _rms_norm_kernel[(rows,)](
            x, x if delta is None else delta, weight, h, y, x.stride(0),
            0 if delta is None else delta.stride(0), eps, N=n, BLOCK=_pow2(n),
            ADD=delta is not None, num_warps=8 if n >= 2048 else 4)
    return h, y


def rope_qk_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_`` of q and k, in one launch where k's heads follow q's in each row (as in
    the QKV product)."""
    t, heads, dim = q.shape
    if (k.data_ptr() == q.data_ptr() + heads * dim * q.element_size()
            and k.stride() == q.stride() and k.dtype == q.dtype):
        both = q.as_strided((t, heads + k.shape[1], dim), q.stride())
        rope_(both, positions, inv_freq)
    else:
        rope_(q, positions, inv_freq)
        rope_(k, positions, inv_freq)
    return q, k


def rope_(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half) of ``x`` [T, heads, head_dim] in place: the heads of
    a row contiguous, rows at any stride (q and k side by side in the QKV product)."""
    t, heads, dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == dim
    if t:
        _rope_kernel[(t, heads)](x, positions, inv_freq, x.stride(0), HALF=dim // 2,
                                 BLOCK=_pow2(dim // 2), num_warps=1)
    return x


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of ``x`` = [gate | up] ([T, 2n]) -> [T, n]."""
    rows, two_n = x.shape
    n = two_n // 2
    assert x.stride(1) == 1
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = min(1024, _pow2(n))
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, y, x.stride(0), N=n, BLOCK=block,
                                                        num_warps=4)
    return y
