"""Multi-head latent attention (DeepSeek V3, Kimi K2, Moonlight: ``ModelConfig.kv_lora_rank``):
each token's k and v for every head are made from one latent vector of ``kv_lora_rank``
(normed), and its q from one of ``q_lora_rank`` (or directly from the hidden state). Each
head's q and k are ``qk_nope_head_dim`` plain dimensions then ``rope_dim`` rotated ones;
the rotated part of k is one for all heads, made beside the latent.

This layer hands the attention ordinary per-head q, k and v: the KV cache holds every
head's k and v (v padded with zeros to k's width), so every attention backend, the store
and the transfers serve it unchanged. The price is memory: a token's KV is
2 x heads x (qk_nope_head_dim + rope_dim) values a layer where DeepSeek's own cache holds
the latent and the rotated key (kv_lora_rank + rope_dim: 576 against 49,152 for DeepSeek
V3's 128 heads); attending in the latent space (the weights absorbed) is not done here.

A checkpoint's interleaved rotary pairs (``rope_interleave``: (x0, x1), (x2, x3), ...) are
made halves at load (``deinterleaved``): rotating the halves of the reordered rows is
rotating the pairs of the original ones, and q . k is the same in either order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from common.model.config import ModelConfig
from common.model.linear import Linear


@dataclass
class LatentAttention:
    q: Linear  # q_proj, or q_b_proj after q_a_proj and its norm
    q_a: Optional[Linear]
    q_a_norm: Optional[torch.Tensor]
    kv_a: Linear  # kv_a_proj_with_mqa: [kv_lora_rank + rope_dim, hidden]
    kv_a_norm: torch.Tensor
    kv_b: Linear  # [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]

    def qkv(self, x: torch.Tensor, cfg: ModelConfig, ops: Any,
            rope: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v [T, heads, head_dim] (v padded) of the normed input ``x``."""
        t, heads, eps = x.shape[0], cfg.num_heads, cfg.rms_norm_eps
        nope, rotated, width = cfg.qk_nope_head_dim, cfg.rope_dim, cfg.v_head_dim
        q_in = x if self.q_a is None else ops.rms_norm(self.q_a(x), self.q_a_norm, eps)
        q = self.q(q_in).view(t, heads, nope + rotated)
        kv = self.kv_a(x)
        latent = ops.rms_norm(kv[:, :cfg.kv_lora_rank].contiguous(), self.kv_a_norm, eps)
        q_rot, k_rot = rope(q[..., nope:].contiguous(),
                            kv[:, cfg.kv_lora_rank:].reshape(t, 1, rotated).contiguous())
        k_v = self.kv_b(latent).view(t, heads, nope + width)
        q = torch.cat([q[..., :nope], q_rot], dim=-1)
        k = torch.cat([k_v[..., :nope], k_rot.expand(t, heads, rotated)], dim=-1)
        v = F.pad(k_v[..., nope:], (0, nope + rotated - width))
        return q, k, v

    @staticmethod
    def output(o: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """The attention's output [T, heads * head_dim] less each head's padding: the
        o_proj's input [T, heads * v_head_dim]."""
        t = o.shape[0]
        return o.view(t, cfg.num_heads, -1)[..., :cfg.v_head_dim].reshape(t, -1)


def deinterleaved(cfg: ModelConfig, rows: int, period: int, start: int) -> torch.Tensor:
    """The order of ``rows`` rows that puts the rotated pairs of each ``period`` rows
    (from ``start`` within it) as halves: evens, then odds."""
    rotated = cfg.rope_dim
    within = torch.cat([torch.arange(0, rotated, 2), torch.arange(1, rotated, 2)])
    order = torch.arange(rows).view(-1, period).clone()
    order[:, start:start + rotated] = order[:, start:start + rotated][:, within]
    return order.reshape(-1)
