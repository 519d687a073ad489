"""Rotary position embeddings (HF rotate-half layout) with the checkpoint's base and scaling."""
from __future__ import annotations

import math
from typing import Optional

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inv_frequencies(dim: int, theta: float, scaling: Optional[dict] = None,
                    freq_factors: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 [dim // 2] inverse frequencies of a RoPE of base ``theta`` after
    ``scaling`` (ModelConfig.rope_scaling's form)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope scaling {kind!r} not supported ({SUPPORTED_ROPE_TYPES})")
    if kind == "linear":
        inv_freq = inv_freq / float(s["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, s)
    if freq_factors is not None:  # llama.cpp's rope_freqs tensor (llama3 GGUFs)
        inv_freq = inv_freq / freq_factors.float()
    return inv_freq


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, 1, head_dim] for broadcasting over heads."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
