"""A prompt chunk's attention after a cached prefix without a mask: the prefix, which
every query sees, and the chunk's own keys, causally, as two unmasked flash-attention calls
merged by their log-sum-exps (``chunk_attention``). ``splits_chunks`` says where that
beats one masked call: on the CPU where torch has its flash op, on a GPU for large chunks
where a variant checked once gives the masked softmax's result. SdpaAttention
(common/model/attention.py) takes it for a chunk after a prefix.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

# torch's CPU flash attention, which also returns the softmax's log-sum-exp per query
# (what F.scaled_dot_product_attention runs on CPU without a mask); None if absent.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

log = logging.getLogger(__name__)

# The CUDA ops that return the log-sum-exp too, fastest first: cuDNN's (on an H200 the
# masked call ran at 262-323 TFLOPS, the two unmasked ones at 428-552), then
# flash-attention 2's; each with grouped K/V heads as given, else expanded to the query's.
_CUDA_LSE = ("cudnn", "cudnn-expanded", "flash", "flash-expanded")
_CUDA_SPLIT: dict[tuple[torch.device, torch.dtype], Optional[str]] = {}


# On a GPU the split pays only for large chunks: its second call and the merge are ~7
# more launches a layer, and a warm 4k prompt's step (416 queries after 3,680 keys) is
# bound by launches (13.7 ms on the card in a 33 ms step, an H200). Per layer (H200,
# LLaMA-3-8B heads): 416 after 3,680 0.133 ms masked, 0.215 split; 2,048 after 2,048
# 0.432 / 0.416; 1,648 after 14,736 1.637 / 0.988 (benchmarks/chunk_attention.py).
SPLIT_MIN_PAIRS_CUDA = 2048 * 2048  # queries x prefix keys


def splits_chunks(device: torch.device, dtype: torch.dtype = torch.float32,
                  queries: int = 2, prefix: int = 1 << 30) -> bool:
    """Whether a chunk of ``queries`` after ``prefix`` keys attends by ``chunk_attention``
    (no mask) on ``device`` in ``dtype``: on the CPU where torch has its flash op; on a
    GPU in 16-bit dtypes, for chunks of at least ``SPLIT_MIN_PAIRS_CUDA``, where one of
    ``_CUDA_LSE`` gives the masked softmax's result on a small case (checked once per
    device and dtype: a torch or card without it keeps the mask)."""
    if queries < 2 or prefix < 1:
        return False
    if device.type == "cpu":
        return _FLASH_CPU is not None
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or (
            queries * prefix < SPLIT_MIN_PAIRS_CUDA):
        return False
    key = _split_key(device, dtype)
    if key not in _CUDA_SPLIT:
        _CUDA_SPLIT[key] = _first_exact_variant(key[0], dtype)
        log.info("prompt chunks after a prefix on %s (%s): %s", key[0], dtype,
                 f"two unmasked {_CUDA_SPLIT[key]} calls" if _CUDA_SPLIT[key] else "masked")
    return _CUDA_SPLIT[key] is not None


def _split_key(device: torch.device, dtype: torch.dtype) -> tuple[torch.device, torch.dtype]:
    return torch.device(device.type, device.index or 0), dtype


def _first_exact_variant(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 8, 40, 128, generator=g, device=device, dtype=dtype)
    k, v = (torch.randn(1, 2, 136, 128, generator=g, device=device, dtype=dtype)
            for _ in range(2))
    start, end = 90, 130  # keys past ``end``: block padding, never seen
    seen = torch.arange(136, device=device)[None, :] <= torch.arange(start, end,
                                                                     device=device)[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=seen[None, None],
                                          enable_gqa=True).float()
    for variant in _CUDA_LSE:
        try:
            got = chunk_attention(q, k, v, start, end, variant=variant).float()
        except Exception as exc:  # not on this torch or card
            log.debug("chunk attention via %s: %r", variant, exc)
            continue
        err = (got - want).abs().max().item() if got.shape == want.shape else float("inf")
        if err < 2e-2:
            return variant
        log.warning("chunk attention via %s differs from the masked softmax by %.3g",
                    variant, err)
    return None


def _lse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: Optional[float], variant: Optional[str],
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention ([B, heads, q_len, hd]) and its log-sum-exp ([B, heads, q_len],
    natural log) by the CPU's flash op or a CUDA ``variant``."""
    if q.device.type == "cpu":
        assert _FLASH_CPU is not None
        out, lse = _FLASH_CPU(q, k, v, is_causal=causal, scale=scale)[:2]
        return out, lse
    if variant is None:
        variant = _CUDA_SPLIT.get(_split_key(q.device, q.dtype))
        if variant is None:
            raise RuntimeError(f"no unmasked attention with log-sum-exp for {q.dtype} here")
    if variant.endswith("-expanded") and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if variant.startswith("cudnn"):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse.reshape(q.shape[:3])


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                    end: int, scale: Optional[float] = None,
                    variant: Optional[str] = None) -> torch.Tensor:
    """A prompt chunk's attention ([1, heads, end - start, hd] queries at positions
    [start, end)) over its sequence's keys [0, end) of ``k``/``v`` ([1, kv heads, >= end,
    hd]): the prefix [0, start), which every query sees, and the chunk's own keys,
    causally, as two unmasked flash-attention calls merged by their log-sum-exps: the
    masked softmax (equal up to float rounding) without applying a [q_len, keys] mask,
    30.2 ms instead of 34.5 for 256 queries over 16k keys on one core. ``start`` > 0.
    On a GPU ``variant`` names the op (``_CUDA_LSE``; default: the one checked)."""
    o1, l1 = _lse_attention(q, k[:, :, :start], v[:, :, :start], False, scale, variant)
    o2, l2 = _lse_attention(q, k[:, :, start:end], v[:, :, start:end], True, scale, variant)
    # o1 w1 + o2 w2 over w1 + w2, with w = exp(lse): o1 + (o2 - o1) * sigmoid(l2 - l1)
    share = torch.sigmoid(l2 - l1).unsqueeze(-1)
    return torch.lerp(o1.float(), o2.float(), share).to(q.dtype)
