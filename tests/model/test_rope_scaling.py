"""YaRN, the RoPE scaling Qwen 2.5 and Qwen 3 document for contexts past their
pretraining length: its frequencies and attention factor equal transformers' for each of
its parameters, a checkpoint with it gives transformers' logits, and a GGUF's YaRN is read
from its metadata (llama.cpp's own YaRN terms refused by name)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine import Engine, EngineConfig
from common.model.arch import UnsupportedModelError, config_from_hf
from common.model.rope import attention_factor, inv_frequencies
from tests.model.tiny_checkpoints import SMALL, assert_decodes_as, write_checkpoint

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0}


@pytest.mark.parametrize("extra", [
    {},
    {"beta_fast": 16, "beta_slow": 2, "rope_theta": 1e6},
    {"truncate": False},
    {"mscale": 1.0, "mscale_all_dim": 0.5},
    {"attention_factor": 1.3},
    {"original_max_position_embeddings": None},  # then max_position_embeddings (256)
], ids=["defaults", "betas", "no-truncate", "mscales", "attention-factor", "no-original"])
def test_yarn_equals_transformers(extra: dict) -> None:
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {k: v for k, v in {**YARN, **extra}.items() if v is not None}
    hf = Qwen2Config(**{**SMALL, "head_dim": 32}, rope_parameters=dict(params))
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    config = config_from_hf(hf.to_dict(), "yarn")
    freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.allclose(freq, want_freq, rtol=1e-6, atol=0)
    assert attention_factor(config.rope_scaling) == pytest.approx(want_factor, rel=1e-12)


@torch.inference_mode()
def test_a_yarn_checkpoint_gives_transformers_logits(tmp_path: Path) -> None:
    """Qwen 3 with YaRN (factor 4: every score 1.30x by the attention factor, the slow
    frequencies / 4): its prefill and decode steps, the factor folded into the scale."""
    hf = write_checkpoint("qwen3", tmp_path, rope_parameters=dict(YARN))
    engine = Engine(EngineConfig(model=str(tmp_path), num_blocks=32, block_size=4))
    prompts = [torch.randint(0, SMALL["vocab_size"], (n,),
                             generator=torch.Generator().manual_seed(n)).tolist()
               for n in (40, 11)]
    assert_decodes_as(engine, hf, prompts, steps=3)


def test_a_gguf_yarn_is_read_and_llama_cpp_terms_refused(tmp_path: Path) -> None:
    import gguf

    from common.model.gguf_loader import hf_config

    def write(name: str, **keys: float) -> gguf.GGUFReader:
        w = gguf.GGUFWriter(str(tmp_path / name), "qwen2")
        for add, value in [(w.add_block_count, 2), (w.add_embedding_length, 64),
                           (w.add_head_count, 4), (w.add_feed_forward_length, 96),
                           (w.add_vocab_size, 320), (w.add_context_length, 256),
                           (w.add_rope_scaling_factor, 4.0),
                           (w.add_rope_scaling_orig_ctx_len, 64)]:
            add(value)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        for key, value in keys.items():
            w.add_float32(f"qwen2.rope.scaling.{key}", value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        return gguf.GGUFReader(str(tmp_path / name))

    scaling = hf_config(write("a.gguf", yarn_beta_fast=16.0))["rope_scaling"]
    assert scaling == {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 64, "beta_fast": 16.0}
    with pytest.raises(UnsupportedModelError,
                       match=r"GGUF YaRN with qwen2\.rope\.scaling\.yarn_log_multiplier"):
        hf_config(write("b.gguf", yarn_log_multiplier=0.1))
