"""Multi-head latent attention (DeepSeek V2 and V3, Kimi K2, Moonlight:
``ModelConfig.kv_lora_rank``): each token's k and v for every head are made from one
latent vector of ``kv_lora_rank`` (normed), and its q from one of ``q_lora_rank`` (or
directly from the hidden state). Each head's q and k are ``qk_nope_head_dim`` plain
dimensions then ``rope_dim`` rotated ones; the rotated part of k is one for all heads,
made beside the latent.

The KV cache holds what DeepSeek's does: a token's latent and rotated key, one KV head
``kv_lora_rank + rope_dim`` wide (576 for DeepSeek V3: 1/85 of every head's k and v), in
its K slot and again in its V slot (the layout has both). The attention runs in the
latent's space, the weights absorbed: head h's plain q is taken into it by its part of
kv_b_proj (q_h W_UK_h: k_h = W_UK_h latent, so q_h . k_h = (q_h W_UK_h) . latent), its
query then attends the cached [latent, rotated key] vectors as one grouped-query head, and
its output, a weighted sum of latents (the rotated key's dimensions dropped), becomes v's
by its other part (W_UV_h). Every attention backend, the KV pool, the store and the
transfers serve it as a model of one KV head. The absorptions are a linear a head (each
row alone, as any linear: batch invariant on the CPU).

A checkpoint's interleaved rotary pairs (``rope_interleave``: (x0, x1), (x2, x3), ...) are
made halves at load (``deinterleaved``): rotating the halves of the reordered rows is
rotating the pairs of the original ones, and q . k is the same in either order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from common.model.config import ModelConfig
from common.model.linear import Linear


@dataclass
class LatentAttention:
    q: Linear  # q_proj, or q_b_proj after q_a_proj and its norm
    q_a: Optional[Linear]
    q_a_norm: Optional[torch.Tensor]
    kv_a: Linear  # kv_a_proj_with_mqa: [kv_lora_rank + rope_dim, hidden]
    kv_a_norm: torch.Tensor
    absorb_q: list[Linear]  # head h's plain q into the latent's space: W_UK_h^T
    absorb_v: list[Linear]  # head h's latent output to its v: W_UV_h

    def linears(self) -> Iterator[tuple[str, Linear]]:
        yield "q", self.q
        if self.q_a is not None:
            yield "q_a", self.q_a
        yield "kv_a", self.kv_a
        for h, (k, v) in enumerate(zip(self.absorb_q, self.absorb_v)):
            yield from ((f"absorb_q.{h}", k), (f"absorb_v.{h}", v))

    def qkv(self, x: torch.Tensor, cfg: ModelConfig, ops: Any,
            rope: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, width] in the latent's space and k = v [T, 1, width] of the normed
        input ``x`` (width: kv_lora_rank + rope_dim, the cache's)."""
        t, heads, eps = x.shape[0], cfg.num_heads, cfg.rms_norm_eps
        nope, rotated, rank = cfg.qk_nope_head_dim, cfg.rope_dim, cfg.kv_lora_rank
        q_in = x if self.q_a is None else ops.rms_norm(self.q_a(x), self.q_a_norm, eps)
        q = self.q(q_in).view(t, heads, nope + rotated)
        kv = self.kv_a(x)
        latent = ops.rms_norm(kv[:, :rank].contiguous(), self.kv_a_norm, eps)
        q_rot, k_rot = rope(q[..., nope:].contiguous(),
                            kv[:, rank:].reshape(t, 1, rotated).contiguous())
        q_latent = torch.stack([absorb(q[:, h, :nope]) for h, absorb
                                in enumerate(self.absorb_q)], dim=1)
        k = torch.cat([latent, k_rot.view(t, rotated)], dim=-1).view(t, 1, rank + rotated)
        return torch.cat([q_latent, q_rot], dim=-1), k, k

    def output(self, o: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """The attention's output [T, heads * width] (each head's weighted latents and
        rotated keys) as the o_proj's input [T, heads * v_head_dim]."""
        o = o.view(o.shape[0], cfg.num_heads, -1)
        return torch.cat([absorb(o[:, h, :cfg.kv_lora_rank]) for h, absorb
                          in enumerate(self.absorb_v)], dim=-1)


def absorbed(cfg: ModelConfig, kv_b: torch.Tensor, pack: bool,
             dtype: Optional[torch.dtype]) -> tuple[list[Linear], list[Linear]]:
    """kv_b_proj's weight [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] as each
    head's two absorptions (``LatentAttention.absorb_q``, ``absorb_v``)."""
    w = kv_b.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    nope = cfg.qk_nope_head_dim
    return ([Linear(w[h, :nope].t().contiguous(), pack, None, dtype) for h in range(len(w))],
            [Linear(w[h, nope:].contiguous(), pack, None, dtype) for h in range(len(w))])


def deinterleaved(cfg: ModelConfig, rows: int, period: int, start: int) -> torch.Tensor:
    """The order of ``rows`` rows that puts the rotated pairs of each ``period`` rows
    (from ``start`` within it) as halves: evens, then odds."""
    rotated = cfg.rope_dim
    within = torch.cat([torch.arange(0, rotated, 2), torch.arange(1, rotated, 2)])
    order = torch.arange(rows).view(-1, period).clone()
    order[:, start:start + rotated] = order[:, start:start + rotated][:, within]
    return order.reshape(-1)
