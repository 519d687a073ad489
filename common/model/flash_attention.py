"""flash-attn's paged attention (``flash_attn_with_kvcache``), on a GPU where its wheel is
installed: ``make_backend``'s "flash" (common/model/attention.py)."""
from __future__ import annotations

import torch

from common.kv.memory import PagedKVMemory
from common.model.attention import AttnMetadata, AttnSpec, SdpaAttention


def flash_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class FlashAttention:
    """flash_attn_with_kvcache on the paged memory (CUDA + flash_attn only).

    flash-attn wants per-layer caches shaped [num_blocks, block_size, kv_heads, head_dim];
    our layer views are strided slices of the one big tensor, which flash-attn accepts as
    long as the last dim is contiguous and block_size is a multiple of 256 for paged mode
    (older versions); otherwise we fall back to SDPA.
    """

    decode_mask = True  # its SDPA fallback's
    prompt_rows_alone = False

    def __init__(self, kv: PagedKVMemory):
        from flash_attn import flash_attn_with_kvcache

        self.kv = kv
        self._fn = flash_attn_with_kvcache
        self._fallback = SdpaAttention(kv)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttnMetadata, spec: AttnSpec) -> torch.Tensor:
        t, heads, hd = q.shape
        if (q.dtype not in (torch.float16, torch.bfloat16) or self.kv.block_size % 256
                or not spec.plain_for(meta.longest)):
            return self._fallback(layer, q, k, v, meta, spec)
        if meta.parts is not None:
            return torch.cat([self(layer, q[s:e], k[s:e], v[s:e], part, spec)
                              for s, e, part in meta.parts])
        self.kv.write_tokens(layer, meta.slot_blocks, meta.positions, k, v)
        layer_kv = self.kv.layer_view(layer)
        out = self._fn(
            q.view(meta.batch, meta.q_len, heads, hd), layer_kv[:, 0], layer_kv[:, 1],
            cache_seqlens=meta.kv_lens, block_table=meta.block_tables.to(torch.int32),
            softmax_scale=spec.scale, causal=True)
        return out.reshape(t, heads * hd)
