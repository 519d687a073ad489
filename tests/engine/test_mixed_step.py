"""A mixed step (prefill chunks of several prompts + a decode batch in one forward) gives
the same logits and the same KV as running each part alone."""
from __future__ import annotations

import pytest
import torch

from common.engine import DecodeInput, Engine, EngineInputError
from common.engine.config import PrefillChunk

ATOL = 1e-5


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def test_mixed_step_equals_each_part_alone(tiny: Engine) -> None:
    # Two decoding sequences, one prompt finishing (cached prefix of 8), one starting.
    decoding = []
    for i, n in enumerate([5, 11]):
        ids = _prompt(n + 1, seed=i)
        blocks = tiny.pool.allocate(tiny.blocks_needed(n + 1))
        tiny.prefill(ids[:n], blocks)
        decoding.append(DecodeInput(ids[n], n, blocks))
    finishing, starting = _prompt(14, seed=7), _prompt(9, seed=8)
    fin_blocks = tiny.pool.allocate(4)
    tiny.prefill(finishing[:8], fin_blocks)          # its first 8 tokens are cached
    start_blocks = tiny.pool.allocate(3)

    ref_fin = tiny.prefill(finishing, tiny.pool.allocate(4))
    ref_decode = torch.stack([tiny.decode_step([d])[0] for d in decoding])
    kv_before = tiny.kv.data.clone()

    layers: list[int] = []
    chunks = [PrefillChunk(finishing, 8, 14, fin_blocks), PrefillChunk(starting, 0, 5, start_blocks)]
    tiny.kv.data.copy_(kv_before)
    per_chunk, dec = tiny.step(chunks, decoding, layer_hook=layers.append)
    assert layers == list(range(tiny.model_config.num_layers))
    assert per_chunk[1] is None                      # the second prompt is not finished
    assert torch.allclose(per_chunk[0], ref_fin, atol=ATOL)
    assert dec is not None and torch.allclose(dec, ref_decode, atol=ATOL)
    # Finish the second prompt with a decode-free step: equals a one-shot prefill.
    last, none = tiny.step([PrefillChunk(starting, 5, 9, start_blocks)])
    assert none is None
    assert torch.allclose(last[0], tiny.prefill(starting, tiny.pool.allocate(3)), atol=ATOL)


def test_step_checks_its_inputs(tiny: Engine) -> None:
    ids = _prompt(6)
    blocks = tiny.pool.allocate(2)
    with pytest.raises(EngineInputError, match="at least one"):
        tiny.step()
    with pytest.raises(EngineInputError, match="outside a prompt"):
        tiny.step([PrefillChunk(ids, 4, 9, blocks)])
    with pytest.raises(EngineInputError, match="block table"):
        tiny.step([PrefillChunk(ids, 0, 6, blocks[:1])])
    with pytest.raises(EngineInputError, match="max_batch_size"):
        tiny.step(decodes=[DecodeInput(1, 0, blocks)] * (tiny.config.max_batch_size + 1))


def test_mixed_step_on_the_real_model_keeps_greedy_tokens(smol: Engine) -> None:
    """SmolLM2: a prompt prefilled inside a mixed step continues with the same greedy
    tokens as the same prompt prefilled alone."""
    a = smol.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    b = smol.apply_chat_template([{"role": "user", "content": "Name a primary colour."}])
    ba = smol.pool.allocate(smol.blocks_needed(len(a)))
    bb = smol.pool.allocate(smol.blocks_needed(len(b) + 1))
    scratch = smol.pool.allocate(smol.blocks_needed(len(a)))
    try:
        first_b = int(smol.prefill(b, bb).argmax())
        alone = int(smol.prefill(a, scratch).argmax())
        logits, dec = smol.step([PrefillChunk(a, 0, len(a), ba)],
                                [DecodeInput(first_b, len(b), bb)])
        assert int(logits[0].argmax()) == alone
        assert dec is not None and dec.shape[0] == 1
    finally:
        smol.pool.free(ba + bb + scratch)
