"""A prompt chunk's attention as two unmasked flash calls merged by their log-sum-exps
(common/model/attention.py) equals the masked softmax over its keys."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model import attention
from common.model.attention import chunk_attention

pytestmark = pytest.mark.skipif(attention._FLASH_CPU is None,
                                reason="this torch has no CPU flash attention op")


@pytest.mark.parametrize("heads, kv_heads, start, q_len, padded", [
    (2, 2, 48, 16, 64), (9, 3, 100, 28, 128), (4, 1, 1, 5, 8), (2, 2, 300, 256, 560)])
def test_equals_the_masked_softmax(heads: int, kv_heads: int, start: int, q_len: int,
                                   padded: int) -> None:
    g = torch.Generator().manual_seed(start)
    q = torch.randn(1, heads, q_len, 32, generator=g)
    k, v = (torch.randn(1, kv_heads, padded, 32, generator=g) for _ in range(2))
    end = start + q_len
    keys, positions = torch.arange(padded), torch.arange(start, end)
    mask = torch.zeros(q_len, padded).masked_fill_(keys[None, :] > positions[:, None],
                                                   float("-inf"))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None],
                                          enable_gqa=True)
    got = chunk_attention(q, k, v, start, end)
    assert got.shape == want.shape and got.dtype == q.dtype
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # keys past the chunk's end (block padding) are never seen
    k[:, :, end:], v[:, :, end:] = 1e4, 1e4
    assert torch.allclose(chunk_attention(q, k, v, start, end), want, atol=1e-5)
