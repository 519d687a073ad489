"""DeepSeek's latent attention (common/model/latent.py) beyond test_architectures.py's
checks against transformers: a YaRN scaling's softmax factor, what the KV cache holds, a
row alone as in a batch under DeepSeek V3's router, and what is refused."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine import Engine, EngineConfig, UnknownModelError
from tests.model.test_architectures import FAMILIES
from tests.model.tiny_checkpoints import (
    assert_alone_as_in_a_batch,
    assert_decodes_as,
    write_checkpoint,
)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1,
        "rope_theta": 10000.0}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def yarn_v3(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("yarn")
    return path, write_checkpoint("deepseek_v3", path, **FAMILIES["deepseek_v3"],
                                  rope_parameters=YARN)


def test_yarns_softmax_factor_and_a_cache_of_the_latent(yarn_v3) -> None:
    """YaRN's mscale_all_dim squared scales the softmax (transformers'
    yarn_apply_mscale); the cache holds one head: the latent and the rotated key."""
    path, hf = yarn_v3
    engine = Engine(EngineConfig(model=str(path), num_blocks=96, block_size=4,
                                 prefill_chunk=7))
    cfg = engine.model_config
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, 32 + 8)
    assert engine.kv.num_kv_heads == 1 and engine.kv.head_dim == 40
    assert cfg.query_scale == pytest.approx((16 + 8) ** -0.5 * (0.1 * 0.8 * torch.log(
        torch.tensor(4.0)).item() + 1) ** 2)
    assert_decodes_as(engine, hf, [_ids(37, seed=1), _ids(13, seed=2)], steps=4)


def test_a_row_is_the_same_alone_as_in_a_batch(yarn_v3) -> None:
    """Bit for bit under V3's sigmoid router (its scores' sigmoid over whole vectors)."""
    engine = Engine(EngineConfig(model=str(yarn_v3[0]), num_blocks=96, block_size=4,
                                 prefill_chunk=7))
    assert not engine.model.graphable
    assert_alone_as_in_a_batch(engine, [_ids(29, seed=3), _ids(11, seed=4), _ids(6, seed=5)],
                               steps=5)


@pytest.mark.parametrize("change, match", [
    ({"rope_parameters": {**YARN, "mscale": 1.0}},
     "YaRN whose mscale differs from its mscale_all_dim"),
    ({"attention_bias": True}, "latent attention with attention_bias"),
    ({"topk_method": "noaux_tc"}, None),  # V3's own: accepted
])
def test_what_latent_attention_refuses(tmp_path: Path, change: dict, match) -> None:
    import json

    write_checkpoint("deepseek_v3", tmp_path, **FAMILIES["deepseek_v3"])
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if match is None:
        Engine(EngineConfig(model=str(tmp_path), num_blocks=8, block_size=4))
        return
    with pytest.raises(UnknownModelError, match=match):
        Engine(EngineConfig(model=str(tmp_path), num_blocks=8, block_size=4))


def test_a_deepseek_v2_router_it_does_not_know_is_refused(tmp_path: Path) -> None:
    import json

    write_checkpoint("deepseek_v2", tmp_path, **FAMILIES["deepseek_v2"])
    config = json.loads((tmp_path / "config.json").read_text())
    config["topk_method"] = "noaux_tc"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownModelError, match="topk_method 'noaux_tc' is not supported"):
        Engine(EngineConfig(model=str(tmp_path), num_blocks=8, block_size=4))
