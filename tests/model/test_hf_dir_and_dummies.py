"""HF safetensors directories, rope scaling, and the named dummy configs."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from common.engine import Engine, EngineConfig
from common.model.config import DUMMY_CONFIGS
from common.model.dummy_weights import random_weights

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 5000.0}


def _write_hf_dir(path: Path, tied: bool) -> None:
    from safetensors.torch import save_file

    cfg = dataclasses.replace(DUMMY_CONFIGS["dummy-tiny"], tie_word_embeddings=tied)
    save_file(random_weights(cfg, seed=3), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rope_parameters": ROPE, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024,
        "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2}))


@pytest.mark.parametrize("tied", [False, True])
@torch.inference_mode()
def test_hf_dir_matches_transformers(tmp_path: Path, tied: bool) -> None:
    from transformers import LlamaForCausalLM

    _write_hf_dir(tmp_path, tied)
    engine = Engine(EngineConfig(model=str(tmp_path), num_blocks=32, block_size=4))
    assert engine.model_config.rope_scaling["rope_type"] == "llama3"
    assert engine.model_config.rope_theta == 5000.0
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = engine.pool.allocate(engine.blocks_needed(len(ids)))
    ours = engine.prefill(ids, blocks)  # 70 > 32 positions: the scaled low frequencies matter
    ref = hf(torch.tensor([ids])).logits[0, -1]
    assert (ours - ref).abs().max().item() < 1e-4


def test_dummy_configs_and_layer_override() -> None:
    c8, c70 = DUMMY_CONFIGS["dummy-llama3-8b"], DUMMY_CONFIGS["dummy-llama3-70b"]
    assert (c8.hidden_size, c8.num_layers, c8.num_heads, c8.num_kv_heads) == (4096, 32, 32, 8)
    assert (c70.hidden_size, c70.num_layers, c70.num_heads, c70.num_kv_heads) == (8192, 80, 64, 8)
    part = c70.with_layers(2)
    assert part.num_layers == 2 and part.name == "dummy-llama3-70b@2L"
    with pytest.raises(ValueError):
        c8.with_layers(0)


def test_dummy_engine_weights_are_seeded_and_layers_overridable() -> None:
    a = Engine(EngineConfig(model="dummy-tiny", num_blocks=8))
    b = Engine(EngineConfig(model="dummy-tiny", num_blocks=8, num_layers=1))
    assert b.model_config.num_layers == 1 and b.kv.shape[1] == 1
    assert torch.equal(a.model.embed, b.model.embed)
    assert a.fingerprint != b.fingerprint
    la = a.prefill([5, 6, 7], a.pool.allocate(1))
    lb = Engine(EngineConfig(model="dummy-tiny", num_blocks=8)).prefill([5, 6, 7], [0])
    assert torch.equal(la, lb)


def test_big_dummies_take_their_linears_from_one_pool() -> None:
    """An 8B dummy's weights in a second, as windows of one 256 MB pool: same shapes as the
    config says, seeded, each row distinct, std 0.02; a small dummy draws every value."""
    import time

    from common.model.dummy_weights import POOL_SIZE

    cfg = DUMMY_CONFIGS["dummy-llama3-8b"]
    t0 = time.perf_counter()
    w = random_weights(cfg, seed=1)
    assert time.perf_counter() - t0 < 10
    embed, gate = w["model.embed_tokens.weight"], w["model.layers.31.mlp.gate_proj.weight"]
    assert embed.shape == (cfg.vocab_size, cfg.hidden_size)
    assert gate.shape == (cfg.intermediate_size, cfg.hidden_size)
    pools = {t.untyped_storage().data_ptr() for n, t in w.items() if n.endswith("proj.weight")}
    assert len(pools) == 1 and embed.untyped_storage().nbytes() == POOL_SIZE * 4
    assert abs(embed[:2000].std().item() - 0.02) < 1e-3
    assert not torch.equal(embed[0], embed[1]) and not torch.equal(gate[0], gate[-1])
    assert torch.equal(random_weights(cfg, seed=1)["model.layers.7.self_attn.k_proj.weight"],
                       w["model.layers.7.self_attn.k_proj.weight"])
    tiny = random_weights(DUMMY_CONFIGS["dummy-tiny"])
    assert tiny["model.embed_tokens.weight"].is_contiguous()
