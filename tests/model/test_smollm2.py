"""The default model against transformers' LlamaForCausalLM loaded from the same GGUF."""
from __future__ import annotations

import pytest
import torch

from common.engine import Engine, SamplingParams, generate
from common.model.loader import default_gguf_path
from tests.model.hf_reference import load_hf_reference

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The capital of Germany is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# transformers' GGUF tokenizer gives exactly these ids for CHAT (checked once by hand).
CHAT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
            411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47,
            2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    return load_hf_reference(default_gguf_path())


def _prompts(engine: Engine) -> list[list[int]]:
    return [engine.encode(p) for p in PROMPTS] + [engine.apply_chat_template(CHAT)]


def _prefill(engine: Engine, ids: list[int]) -> torch.Tensor:
    blocks = engine.pool.allocate(engine.blocks_needed(len(ids)))
    try:
        return engine.prefill(ids, blocks)
    finally:
        engine.pool.free(blocks)


def test_chat_template_ids(smol: Engine) -> None:
    assert smol.apply_chat_template(CHAT) == CHAT_IDS
    assert smol.encode("Hello world, the quick") == [19556, 905, 28, 260, 2365]
    assert smol.decode_tokens(CHAT_IDS[-4:]) == "assistant\n"


@torch.inference_mode()
def test_logits_match_transformers(smol: Engine, hf: torch.nn.Module) -> None:
    for ids in _prompts(smol):
        ref = hf(torch.tensor([ids])).logits[0, -1]
        ours = _prefill(smol, ids)
        assert ours.shape == ref.shape == (smol.model_config.vocab_size,)
        assert (ours - ref).abs().max().item() < 2e-3
    smol.pool.check_integrity()


@torch.inference_mode()
def test_greedy_32_tokens_match_transformers(smol: Engine, hf: torch.nn.Module) -> None:
    for ids in _prompts(smol)[1:3]:
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=32, do_sample=False, pad_token_id=2)[0, len(ids):].tolist()
        ours = generate(smol, ids, SamplingParams(max_tokens=32, temperature=0)).token_ids
        assert ours == ref
    smol.pool.check_integrity()


def test_capital_of_france(smol: Engine) -> None:
    result = generate(smol, smol.apply_chat_template(CHAT), SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in result.text
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] in smol.model_config.eos_token_ids


def test_stop_string_cuts_text(smol: Engine) -> None:
    result = generate(smol, smol.apply_chat_template(CHAT),
                      SamplingParams(max_tokens=24, temperature=0, stop=[" Paris"], logprobs=True))
    assert (result.text, result.finish_reason) == ("The capital of France is", "stop")
    assert len(result.logprobs) == len(result.token_ids) and all(lp <= 0 for lp in result.logprobs)


def test_chunked_and_cached_prefill_on_real_model(smol: Engine) -> None:
    ids = smol.encode(PROMPTS[0] + PROMPTS[2])
    one_shot = _prefill(smol, ids)
    blocks = smol.pool.allocate(smol.blocks_needed(len(ids)))
    smol.config.prefill_chunk = 7
    try:
        chunked = smol.prefill(ids, blocks)
        cached = smol.prefill(ids, blocks, num_cached_tokens=16)
    finally:
        smol.config.prefill_chunk = 512
        smol.pool.free(blocks)
    assert torch.allclose(one_shot, chunked, atol=1e-4)
    assert torch.allclose(one_shot, cached, atol=1e-4)


def test_model_config_from_gguf(smol: Engine) -> None:
    c = smol.model_config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (49152, 576, 1536, 30)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    # the turn ends at <|im_end|> (the file's end) and at <|endoftext|>, as in llama.cpp
    assert (c.rope_theta, c.tie_word_embeddings, c.eos_token_ids, c.bos_token_id) == (100000.0, True, (2, 0), 1)
    assert c.max_position_embeddings == 8192
