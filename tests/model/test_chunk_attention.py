"""A prompt chunk's attention as two unmasked flash calls merged by their log-sum-exps
(common/model/chunk_attention.py) equals the masked softmax over its keys."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model import chunk_attention as split
from common.model.chunk_attention import chunk_attention

pytestmark = pytest.mark.skipif(split._FLASH_CPU is None,
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


def test_which_chunks_split() -> None:
    """On the CPU every chunk of several queries after a prefix; on a GPU only 16-bit
    chunks of at least SPLIT_MIN_PAIRS_CUDA (decided before any CUDA call)."""
    from common.model.chunk_attention import SPLIT_MIN_PAIRS_CUDA, splits_chunks

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert splits_chunks(cpu, torch.float32, 2, 1) and splits_chunks(cpu, torch.bfloat16, 416, 3680)
    assert not splits_chunks(cpu, torch.float32, 1, 100)  # one query: decode's path
    assert not splits_chunks(cpu, torch.float32, 16, 0)  # no prefix: fresh causal
    assert not splits_chunks(gpu, torch.bfloat16, 416, 3680)  # a warm 4k prompt's tenth
    assert not splits_chunks(gpu, torch.bfloat16, 2048, SPLIT_MIN_PAIRS_CUDA // 2048 - 1)
    assert not splits_chunks(gpu, torch.float32, 2048, 14336)
    assert not splits_chunks(torch.device("meta"), torch.bfloat16, 2048, 14336)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_chunks_attend_unmasked(dtype: torch.dtype) -> None:
    """On a GPU a chunk after a prefix takes the unmasked split (cuDNN's or flash's op),
    equal to the masked softmax at LLaMA-3-8B's heads, over the padding of whole blocks."""
    from common.model.chunk_attention import _CUDA_SPLIT, splits_chunks

    device = torch.device("cuda")
    assert splits_chunks(device, dtype), "no unmasked attention with log-sum-exp here"
    assert not splits_chunks(device, torch.float32)  # fp32: the masked path, as before
    variant = _CUDA_SPLIT[(torch.device("cuda", 0), dtype)]
    print(f"{dtype}: {variant}")
    g = torch.Generator(device=device).manual_seed(1)
    for start, q_len, padded in [(3680, 416, 4096), (14736, 1648, 16384), (2048, 2048, 4096)]:
        q = torch.randn(1, 32, q_len, 128, generator=g, device=device, dtype=dtype)
        k, v = (torch.randn(1, 8, padded, 128, generator=g, device=device, dtype=dtype)
                for _ in range(2))
        end = start + q_len
        seen = (torch.arange(padded, device=device)[None, :]
                <= torch.arange(start, end, device=device)[:, None])
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=seen[None, None],
                                              enable_gqa=True).float()
        got = chunk_attention(q, k, v, start, end).float()
        assert (got - want).abs().max().item() < 1e-2, (start, q_len)
