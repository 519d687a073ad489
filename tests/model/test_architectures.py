"""Every family common/model/arch.py serves gives transformers' own logits (float32, within
1e-4) from a tiny random checkpoint that transformers builds and saves here: on a whole
prefill, on a prefill in chunks after a cached prefix, and on batched decode steps, with
prompts longer than the sliding window. Anything else is refused at load by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.engine import Engine, EngineConfig, UnknownModelError
from tests.model.tiny_checkpoints import (
    SMALL,
    assert_decodes_as,
    reference_logits,
    write_checkpoint,
)

WINDOW = 8  # tokens: the prompts below are 3-5 windows long
# transformers' model_type -> what its config needs beyond SMALL to use every feature
FAMILIES = {
    "llama": {"attention_bias": True, "mlp_bias": True,
              "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "rope_theta": 5000.0,
                                  "original_max_position_embeddings": 16}},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen3": {"tie_word_embeddings": True},
    "gemma2": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24,
               "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
    "gemma3_text": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                    "sliding_window_pattern": 2,
                    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                           "rope_theta": 1e5},
                                        "sliding_attention": {"rope_type": "default",
                                                              "rope_theta": 1e3}}},
    # mixtures of experts: 6 experts, 2 a token (prompts of 5-41 tokens route to all)
    "mixtral": {"sliding_window": WINDOW, "num_local_experts": 6, "num_experts_per_tok": 2,
                "intermediate_size": 32},
    "qwen2_moe": {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                  "shared_expert_intermediate_size": 40, "decoder_sparse_step": 1,
                  "mlp_only_layers": [1], "norm_topk_prob": False},
    "qwen3_moe": {"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 24,
                  "norm_topk_prob": True, "decoder_sparse_step": 2},
    # the whole q and k projections normed; 6 experts, 2 a token, of intermediate_size
    "olmoe": {"num_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 32},
    # latent attention (q through its own latent), 8 experts in 4 groups scored by their
    # best, 2 groups a token, no renormalization, a shared expert
    "deepseek_v2": {"num_key_value_heads": 4, "head_dim": 8, "q_lora_rank": 24,
                    "kv_lora_rank": 32,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
                    "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4,
                    "topk_group": 2, "topk_method": "group_limited_greedy",
                    "moe_intermediate_size": 24, "n_shared_experts": 2,
                    "first_k_dense_replace": 1, "routed_scaling_factor": 1.5},
    # latent attention (q directly, interleaved rotary pairs) and 8 experts in 4 groups,
    # 2 groups a token, a shared expert, the first layer dense
    "deepseek_v3": {"num_key_value_heads": 4, "head_dim": 8, "q_lora_rank": None,
                    "kv_lora_rank": 32,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
                    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
                    "topk_group": 2, "moe_intermediate_size": 24, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5},
}


def _write_checkpoint(model_type: str, path: Path) -> torch.nn.Module:
    return write_checkpoint(model_type, path, **FAMILIES[model_type])


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, SMALL["vocab_size"], (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(the checkpoint's directory, transformers' model) of one family."""
    path = tmp_path_factory.mktemp(request.param)
    return path, _write_checkpoint(request.param, path)


@pytest.fixture(scope="module")
def pair(family):
    """(our engine, prefilling in chunks of 7 tokens; transformers' model)."""
    path, hf = family
    return Engine(EngineConfig(model=str(path), num_blocks=96, block_size=4,
                               prefill_chunk=7)), hf


@torch.inference_mode()
def test_a_whole_prefill_equals_transformers(family) -> None:
    path, hf = family
    engine = Engine(EngineConfig(model=str(path), num_blocks=32, block_size=4))
    ids = _ids(41, seed=5)
    got = engine.prefill(ids, engine.pool.allocate(engine.blocks_needed(len(ids))))
    assert (got - reference_logits(hf, ids)[-1]).abs().max().item() < 1e-4


@torch.inference_mode()
def test_prefill_in_chunks_after_a_cached_prefix_equals_transformers(pair) -> None:
    engine, hf = pair
    ids = _ids(37, seed=1)  # 37 tokens in chunks of 7 over windows of 8
    want = reference_logits(hf, ids)
    blocks = engine.pool.allocate(engine.blocks_needed(len(ids)))
    whole = engine.prefill(ids, blocks)
    assert (whole - want[-1]).abs().max().item() < 1e-4
    again = engine.prefill(ids, blocks, num_cached_tokens=22)  # the first 22 from the cache
    assert (again - want[-1]).abs().max().item() < 1e-4
    engine.pool.free(blocks)


def test_batched_decode_equals_transformers(pair) -> None:
    engine, hf = pair
    # the longest passes 4 windows
    assert_decodes_as(engine, hf, [_ids(13, seed=2), _ids(29, seed=3), _ids(5, seed=4)],
                      steps=6)


def _saved_llama(path: Path) -> None:
    _write_checkpoint("llama", path)


def test_an_unknown_architecture_is_refused_by_name(tmp_path: Path) -> None:
    _saved_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownModelError, match="architecture GPTNeoXForCausalLM is not "
                                                "supported"):
        Engine(EngineConfig(model=str(tmp_path), num_blocks=8, block_size=4))


def test_a_weight_the_family_does_not_read_is_refused(tmp_path: Path) -> None:
    """A Qwen2-style bias in a LLaMA checkpoint without ``attention_bias``: LLaMA would
    silently skip it."""
    from safetensors.torch import load_file, save_file

    _saved_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["attention_bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights = {k: v for k, v in weights.items() if "o_proj.bias" not in k}
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnknownModelError, match=r"does not read weight "
                                                r"'model\.layers\.0\.self_attn\.k_proj\.bias' "
                                                r"and \d+ more"):
        Engine(EngineConfig(model=str(tmp_path), num_blocks=8, block_size=4))


@pytest.mark.parametrize("role", ["router", "prefill"])
def test_a_service_refuses_it_at_start_with_one_line(tmp_path: Path, role: str) -> None:
    import subprocess
    import sys

    _saved_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["Phi3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", f"services.{role}", "--set",
                           f"model={tmp_path}", "--set", "base_port=24500", "--set",
                           "store.enabled=false"], cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert (f"{role}-0 could not start: model {tmp_path}: architecture Phi3ForCausalLM is "
            "not supported") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_two_checkpoints_of_one_config_never_share_block_keys(tmp_path: Path) -> None:
    """A fine-tune has its base's config.json: the weights themselves tell them apart."""
    from safetensors.torch import load_file, save_file

    from common.model.loader import hf_dir_config

    base, tuned = tmp_path / "a" / "model", tmp_path / "b" / "model"  # one name
    _saved_llama(base)
    _saved_llama(tuned)
    weights = load_file(str(tuned / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1e-3
    save_file(weights, str(tuned / "model.safetensors"))
    (tuned / "config.json").write_text((base / "config.json").read_text())
    ids = _ids(16, seed=6)
    keys = [Engine(EngineConfig(model=str(p), num_blocks=8, block_size=4)).block_keys(ids)
            for p in (base, tuned)]
    assert hf_dir_config(str(base)).weights_id != hf_dir_config(str(tuned)).weights_id
    assert not set(keys[0]) & set(keys[1])


@torch.inference_mode()
def test_pipeline_stages_equal_transformers(family) -> None:
    """Two stages (layers 0-1 and 2): the first embeds (Gemma: scaled), the last has the
    final norm and the soft-capped head; windows follow the model's layer numbers."""
    from common.engine.config import PrefillChunk

    path, hf = family
    stages = [Engine(EngineConfig(model=str(path), num_blocks=32, block_size=4,
                                  stage=(i, 2))) for i in range(2)]
    ids = _ids(30, seed=7)
    hidden = None
    for engine in stages:
        table = engine.pool.allocate(engine.blocks_needed(len(ids)))
        hidden, logits = engine.stage_step([PrefillChunk(ids, 0, len(ids), table)], hidden)
    assert (logits[0] - reference_logits(hf, ids)[-1]).abs().max().item() < 1e-4
