"""Rotary position embeddings (HF rotate-half layout) with the checkpoint's base and scaling."""
from __future__ import annotations

import math
from typing import Optional

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): each frequency between itself (those that turn often
    within the original context) and itself / ``factor`` (those that do not), blended
    linearly over the dimensions between ``beta_fast`` and ``beta_slow`` turns; as
    transformers' ``_compute_yarn_parameters`` and llama.cpp's ``rope_yarn``."""
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(turns: float) -> float:  # the dimension that turns ``turns`` times
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / (
        (high + 0.001 if low == high else high) - low)
    keep = 1 - ramp.clamp(0, 1)  # 1: the frequency as it is (extrapolated)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def attention_factor(scaling: Optional[dict]) -> float:
    """What a RoPE scaling multiplies cos and sin by (YaRN's: 0.1 ln(factor) + 1 unless
    stated), so q . k by its square: the model folds that into the attention's scale."""
    s = scaling or {}
    if s.get("rope_type", s.get("type")) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = float(s["factor"]), s.get("mscale"), s.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


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
    elif kind == "yarn":
        inv_freq = _yarn(inv_freq, dim, theta, s)
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
