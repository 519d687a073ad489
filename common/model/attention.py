"""Attention over the paged KV memory. Backends: a C kernel (the CPU's decode: reads the
blocks in place), torch SDPA (the CPU's prompts, and its decode without a C compiler),
Triton (the GPU's: decode reads the blocks in place) and flash-attn (where its wheel
exists).

Every backend first writes the new tokens' K/V into their slots, then attends over the
sequence's blocks (SDPA gathers them through its block table).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.nn.functional as F

from common.kv.memory import PagedKVMemory
from common.model import cpu_attention, triton_ops
from common.model.chunk_attention import chunk_attention, splits_chunks


@dataclass
class AttnMetadata:
    """One forward step: B sequences with q_len new tokens each (T = B * q_len)."""
    batch: int
    q_len: int
    positions: torch.Tensor       # [T] absolute positions of the new tokens
    slot_blocks: torch.Tensor     # [T] block id that holds each new token
    block_tables: torch.Tensor    # [B, max_blocks] (padded with any valid block id)
    kv_lens: torch.Tensor         # [B] context length after this step (int32)
    kv_lens_list: list[int]
    mask: Optional[torch.Tensor]  # [B, 1, q_len, S] additive (0 / -inf) or bool (True =
    #                               attend); None = fresh causal
    fresh: bool = False           # single sequence starting at 0: attend the new K/V directly
    slot_rows: Optional[torch.Tensor] = None  # [T] PagedKVMemory.token_rows (fast writes)
    # A CUDA graph's block tables: one flat buffer, row b at ``table_stride`` (a device
    # scalar) x b, so a step copies only the columns it uses (TritonAttention only).
    table_stride: Optional[torch.Tensor] = None
    # A mixed step (Sarathi-style: prefill chunks of several prompts and a decode batch in
    # one forward): ``parts`` are (first token, end token, metadata of that part). The
    # linear layers run once over all T tokens; attention runs once per part.
    parts: Optional[list[tuple[int, int, "AttnMetadata"]]] = None
    # One piece of a prompt chunk cut in several (batch invariance: EngineConfig.
    # chunk_align): the whole chunk's block table, one tensor for all its pieces, whose K/V
    # SdpaAttention gathers once per layer for them all (per piece it gathered the chunk's
    # prefix again for each: 16 times for a 256-token chunk in 16-token pieces).
    chunk_table: Optional[torch.Tensor] = None

    @functools.cached_property
    def longest(self) -> int:
        """The longest context after this step (0 in a CUDA graph's metadata, which keeps
        its lengths on the device: graphs serve only models whose attention is plain)."""
        return max(self.kv_lens_list, default=0)


@dataclass(frozen=True)
class AttnSpec:
    """How one layer attends (common/model/arch.py): softmax(q k^T * ``scale``) over the
    earlier keys, with the scores soft-capped (``softcap`` * tanh(s / ``softcap``)) and
    only the last ``window`` keys seen (the query's own included) where set."""
    scale: float
    softcap: Optional[float] = None
    window: Optional[int] = None

    def plain_for(self, longest: int) -> bool:
        """Whether a step whose longest context is ``longest`` keys needs neither the
        soft-cap nor the window (a window at least that long changes nothing)."""
        return self.softcap is None and (self.window is None or longest <= self.window)


class AttentionBackend(Protocol):
    decode_mask: bool  # whether a decode step's metadata must carry a mask
    # whether a prompt row's attention is computed alone, whatever chunk it is in: then a
    # batch-invariant engine need not cut chunks into aligned parts (Engine._pieces)
    prompt_rows_alone: bool

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttnMetadata, spec: AttnSpec) -> torch.Tensor: ...


class SdpaAttention:
    """torch scaled_dot_product_attention over K/V gathered with index_select."""

    decode_mask = True
    prompt_rows_alone = False

    def __init__(self, kv: PagedKVMemory):
        self.kv = kv
        self._bufs: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def _gather_buffers(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bufs is None or self._bufs[0].numel() < numel:
            mk = lambda: torch.empty(numel, dtype=self.kv.dtype, device=self.kv.data.device)
            self._bufs = (mk(), mk())
        return self._bufs

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttnMetadata, spec: AttnSpec) -> torch.Tensor:
        if meta.slot_rows is not None:
            self.write_rows(layer, meta.slot_rows, k, v)
        else:
            self.kv.write_tokens(layer, meta.slot_blocks, meta.positions, k, v)
        if meta.parts is None:
            return self.attend_written(layer, q, k, v, meta, spec)
        out, chunk, gathered = [], None, None
        for s, e, part in meta.parts:
            context = None
            if part.chunk_table is not None and not part.fresh:
                if part.chunk_table is not chunk:  # the chunk's first piece after a prefix
                    chunk = part.chunk_table
                    gathered = self._gathered(layer, chunk[None], q.dtype)
                n = part.block_tables.shape[1] * self.kv.block_size  # this piece's keys:
                context = (gathered[0][:, :n], gathered[1][:, :n])  # what it would gather
            out.append(self.attend_written(layer, q[s:e], k[s:e], v[s:e], part, spec, context))
        return torch.cat(out)

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> None:
        self.kv.write_rows(layer, rows, k, v)

    def _gathered(self, layer: int, tables: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the blocks of ``tables`` [B, n], [B, n * block_size, kv heads, hd] in
        ``dtype`` (one buffer pair, reused by the next gather)."""
        kv = self.kv
        numel = tables.numel() * kv.block_size * kv.num_kv_heads * kv.head_dim
        kk, vv = kv.gather(layer, tables, self._gather_buffers(numel))
        return kk.to(dtype), vv.to(dtype)

    def _window_origin(self, meta: AttnMetadata, spec: AttnSpec) -> int:
        """The first key any query of ``meta`` sees through ``spec``'s window, down to its
        block's start (row b's first query is at position kv_lens[b] - q_len; from the
        host's lengths: no device sync)."""
        if spec.window is None:
            return 0
        first = min(meta.kv_lens_list) - meta.q_len - spec.window + 1
        return max(0, first) // self.kv.block_size * self.kv.block_size

    def attend_written(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       meta: AttnMetadata, spec: AttnSpec,
                       context: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                       ) -> torch.Tensor:
        """Attention of one uniform part whose new K/V are already in the paged memory;
        ``context``: its keys and values gathered already (``_gathered``'s, a prefix of
        its chunk's: the same bytes in the same layout as its own gather)."""
        t, heads, hd = q.shape
        b, ql = meta.batch, meta.q_len
        qb = q.view(b, ql, heads, hd).transpose(1, 2)
        end = meta.longest
        origin = 0  # the first key gathered: a sliding window's first block, else 0
        if meta.fresh:
            kk, vv = k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)
        else:
            if context is None and not spec.plain_for(end):
                origin = self._window_origin(meta, spec)
            kk, vv = context or self._gathered(
                layer, meta.block_tables[:, origin // self.kv.block_size:], q.dtype)
            kk, vv = kk.transpose(1, 2), vv.transpose(1, 2)
        if not spec.plain_for(end):
            out = masked_attention(qb, kk, vv, meta.positions.view(b, ql), spec, origin)
        elif meta.fresh:
            out = F.scaled_dot_product_attention(qb, kk, vv, is_causal=True, scale=spec.scale,
                                                 enable_gqa=True)
        elif b == 1 and splits_chunks(q.device, q.dtype, ql, end - ql):
            out = chunk_attention(qb, kk, vv, end - ql, end, spec.scale)  # after a prefix
        else:
            out = F.scaled_dot_product_attention(qb, kk, vv, attn_mask=meta.mask,
                                                 scale=spec.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(t, heads * hd)


QUERY_TILE = 512  # masked_attention's queries per pass: bounds its [heads, tile, keys] scores


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor, spec: AttnSpec, origin: int = 0) -> torch.Tensor:
    """Attention with ``spec``'s soft-cap and window: ``q`` [B, heads, q_len, hd] at
    ``positions`` [B, q_len] over ``k``/``v`` [B, kv heads, S, hd], key j being position
    ``origin`` + j of its sequence (what the paged memory gathers from block ``origin`` /
    block size on, and a fresh prompt's own K/V). Query tiles of ``QUERY_TILE`` bound the
    score matrix a long prompt needs."""
    keys = torch.arange(origin, origin + k.shape[2], device=q.device)
    group = q.shape[1] // k.shape[1]
    if spec.softcap is not None and group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = []
    for s in range(0, q.shape[2], QUERY_TILE):
        qt = q[:, :, s:s + QUERY_TILE]
        behind = positions[:, None, s:s + QUERY_TILE, None] - keys  # [B, 1, tile, S]
        seen = behind >= 0
        if spec.window is not None:
            seen &= behind < spec.window
        if spec.softcap is None:
            out.append(F.scaled_dot_product_attention(qt, k, v, attn_mask=seen,
                                                      scale=spec.scale, enable_gqa=True))
            continue
        scores = torch.matmul(qt, k.transpose(-1, -2)) * spec.scale
        scores = (torch.tanh(scores / spec.softcap) * spec.softcap).masked_fill(~seen, -math.inf)
        out.append(torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), v))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


class CpuPagedAttention(SdpaAttention):
    """The CPU's backend where common/model/cpu_attention.py's kernel builds: a decode
    part (one new token per sequence) reads each sequence's blocks in place, with no
    gather, no padding to the longest and no mask, every row alone (batch invariant); a
    sliding layer's rows read only the blocks of their window. With ``prompt_rows``
    (batch invariance) so does a prompt chunk (its rows over their sequence's blocks, each
    alone) where the blocks are of 16 tokens and the heads 64, 128, 256 or 576 (latent)
    wide: the same rows whatever chunks the load cuts a prompt into; on one thread as
    fast as torch's flash attention over the whole chunk and 1.1-1.2x faster than over
    16-token parts (what batch invariance cost before), on two 0.8x the whole chunk's
    (torch's spinning OpenMP workers slow the kernel's second thread). Other prompt
    chunks, and soft-capped layers (Gemma 2's), attend through SDPA."""

    decode_mask = False

    def __init__(self, kv: PagedKVMemory, kernel: "cpu_attention.PagedAttentionKernel",
                 prompt_rows: bool = True):
        super().__init__(kv)
        self.kernel = kernel
        self.prompt_rows_alone = prompt_rows and kernel.supports_chunks(kv)

    def attend_written(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       meta: AttnMetadata, spec: AttnSpec,
                       context: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                       ) -> torch.Tensor:
        if spec.softcap is not None:
            return super().attend_written(layer, q, k, v, meta, spec, context)
        if meta.q_len == 1 and not meta.fresh:
            out = self.kernel.attend(q, self.kv, layer, meta.block_tables, None,
                                     meta.kv_lens, spec.scale, meta.longest, spec.window)
        elif meta.batch == 1 and self.prompt_rows_alone:
            out = self.kernel.attend_chunk(q, self.kv, layer, meta.block_tables[0],
                                           meta.longest - meta.q_len, spec.scale,
                                           spec.window)
        else:
            return super().attend_written(layer, q, k, v, meta, spec, context)
        return out.to(q.dtype).view(q.shape[0], -1)


class TritonAttention(SdpaAttention):
    """The GPU's backend (common/model/triton_ops.py): one launch writes a step's K/V, and
    a decode part (one new token per sequence) reads each sequence's blocks in place, with
    no gather and no mask; its launches take a CUDA graph (common/engine/cuda_graphs.py).
    Prompt chunks of several tokens attend through SDPA as before."""

    decode_mask = False

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> None:
        triton_ops.write_kv(self.kv.data, layer, rows, k, v)

    def attend_written(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       meta: AttnMetadata, spec: AttnSpec,
                       context: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                       ) -> torch.Tensor:
        if meta.q_len == 1 and not meta.fresh and spec.plain_for(meta.longest):
            return triton_ops.paged_decode_attention(
                q, self.kv.layer_view(layer), meta.block_tables, meta.kv_lens,
                table_stride=meta.table_stride, scale=spec.scale)
        return super().attend_written(layer, q, k, v, meta, spec, context)


def make_backend(name: str, kv: PagedKVMemory, prompt_rows: bool = True) -> AttentionBackend:
    """``auto``: on a GPU flash-attn where installed, else Triton where installed; on the
    CPU its paged kernel where it builds, else SDPA. ``triton`` runs on the CPU only in
    Triton's interpreter (tests). ``prompt_rows``: the CPU kernel computes prompt rows
    too (each alone: a batch-invariant engine's), else SDPA does, whole chunks at once."""
    from common.model.flash_attention import FlashAttention, flash_available

    if name == "auto":
        if kv.data.is_cuda:
            name = "flash" if flash_available() else (
                "triton" if triton_ops.available() else "sdpa")
        else:
            cpu = cpu_attention.kernel()
            name = "cpu" if cpu is not None and cpu.supports(kv) else "sdpa"
    if name == "sdpa":
        return SdpaAttention(kv)
    if name == "cpu":
        cpu = cpu_attention.kernel()
        if cpu is None or not cpu.supports(kv):
            raise RuntimeError("attention_backend 'cpu' needs a C compiler and KV in host "
                               f"memory as float32 or bfloat16 (here {kv.dtype})")
        return CpuPagedAttention(kv, cpu, prompt_rows)
    if name == "triton":
        if not triton_ops.usable_on(kv.data.device):
            raise RuntimeError("attention_backend 'triton' needs the triton package and a "
                               "CUDA device (or TRITON_INTERPRET=1)")
        return TritonAttention(kv)
    if name == "flash":
        if not flash_available():
            raise RuntimeError("attention_backend 'flash' needs CUDA and the flash_attn package")
        return FlashAttention(kv)
    raise ValueError(f"unknown attention_backend {name!r} (auto, cpu, sdpa, triton, flash)")
