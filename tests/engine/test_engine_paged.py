"""Paged prefill/decode on dummy-tiny: every path gives the same logits."""
from __future__ import annotations

import torch

from common.engine import DecodeInput, Engine

ATOL = 1e-5


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def test_one_shot_chunked_and_cached_prefix_agree(tiny: Engine) -> None:
    ids = _prompt(23)
    a = tiny.pool.allocate(6)
    one_shot = tiny.prefill(ids, a)
    tiny.config.prefill_chunk = 5
    b = tiny.pool.allocate(6)
    chunked = tiny.prefill(ids, b)
    assert torch.allclose(one_shot, chunked, atol=ATOL)
    # reuse the first 3 blocks (12 tokens) of `a` and compute only the rest into fresh blocks
    c = a[:3] + tiny.pool.allocate(3)
    calls: list[tuple[int, int, int]] = []
    cached = tiny.prefill(ids, c, num_cached_tokens=12, layer_hook=lambda *x: calls.append(x))
    assert torch.allclose(one_shot, cached, atol=ATOL)
    assert calls == [(0, 12, 17), (1, 12, 17), (0, 17, 22), (1, 17, 22), (0, 22, 23), (1, 22, 23)]
    assert torch.allclose(tiny.kv.data[c[3]], tiny.kv.data[a[3]], atol=ATOL)


def test_prefill_of_fully_cached_prompt_recomputes_only_last_token(tiny: Engine) -> None:
    ids = _prompt(12)
    blocks = tiny.pool.allocate(3)
    ref = tiny.prefill(ids, blocks)
    calls: list[tuple[int, int, int]] = []
    again = tiny.prefill(ids, blocks, num_cached_tokens=12, layer_hook=lambda *x: calls.append(x))
    assert calls == [(0, 11, 12), (1, 11, 12)]
    assert torch.allclose(ref, again, atol=ATOL)


def test_decode_continues_prefill_exactly(tiny: Engine) -> None:
    ids = _prompt(10)
    blocks = tiny.pool.allocate(3)
    tiny.prefill(ids[:9], blocks)
    step = tiny.decode_step([DecodeInput(ids[9], 9, blocks)])[0]
    full = tiny.prefill(ids, tiny.pool.allocate(3))
    assert torch.allclose(step, full, atol=ATOL)


def test_batched_decode_equals_each_alone(tiny: Engine) -> None:
    lengths = [3, 9, 17, 6]
    seqs = []
    for i, n in enumerate(lengths):
        ids = _prompt(n + 4, seed=i)
        blocks = tiny.pool.allocate(tiny.blocks_needed(n + 4))
        tiny.prefill(ids[:n], blocks)
        seqs.append((ids, blocks, n))
    alone = {}
    for step in range(4):  # decode each sequence alone, then redo the same steps as one batch
        for i, (ids, blocks, n) in enumerate(seqs):
            alone[i, step] = tiny.decode_step([DecodeInput(ids[n + step], n + step, blocks)])[0]
    for step in range(4):
        batch = [DecodeInput(ids[n + step], n + step, blocks) for ids, blocks, n in seqs]
        logits = tiny.decode_step(batch)
        assert logits.shape == (4, tiny.model_config.vocab_size)
        for i in range(4):
            assert torch.allclose(logits[i], alone[i, step], atol=ATOL)
    tiny.pool.check_integrity()


def test_kv_lands_in_the_callers_blocks_only(tiny: Engine) -> None:
    blocks = [7, 2]
    tiny.prefill(_prompt(6), blocks)
    touched = (tiny.kv.data.flatten(1).abs().sum(1) > 0).nonzero().flatten().tolist()
    assert touched == [2, 7]
    assert tiny.kv.data[2, :, :, 2:].abs().sum() == 0  # tokens 4, 5 fill offsets 0, 1 of block 2


def test_a_chunks_mask_is_causal_from_its_start(tiny: Engine) -> None:
    """Query i of a chunk at ``start`` (position start + i) sees exactly keys
    [0, start + i], over a block-rounded key width: what the full comparison gives."""
    for start, q_len, width in [(1, 1, 4), (12, 5, 20), (16, 16, 32), (30, 2, 32), (3, 7, 12)]:
        positions = torch.arange(start, start + q_len)
        keys = torch.arange(width)
        want = tiny.meta.additive_mask(keys[None, :] <= positions[:, None])
        got = tiny.meta.chunk_mask(start, q_len, width)
        assert torch.equal(got, want), (start, q_len, width)
        assert got.dtype == tiny.dtype and got.shape == (q_len, width)
