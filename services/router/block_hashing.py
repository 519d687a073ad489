"""Block keys of a prompt as the conductor matches them: hex of the chained 128-bit keys.

The fingerprint must equal the one the workers use (``common.kv.block_keys``), or no
prefix will ever match. It is taken from the model's ``ModelConfig``: a named dummy
config, the engine's own config loader when it exposes one, else one built here from
the GGUF metadata (no weights are read).
"""
from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Optional

from common.config import ClusterConfig

log = logging.getLogger(__name__)

# Where the engine may expose "model name → ModelConfig without weights" (first found wins).
_LOADERS = (("common.model.loader", "load_model_config"),
            ("common.model.gguf", "load_model_config"),
            ("common.model", "load_model_config"))


def _engine_model_config(model: str) -> Optional[Any]:
    try:
        from common.model.config import DUMMY_CONFIGS
        if model in DUMMY_CONFIGS:
            return DUMMY_CONFIGS[model]
    except ImportError:
        return None
    for module_name, attr in _LOADERS:
        try:
            loader = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            continue
        return loader(model)
    return None


def _gguf_model_config(model: str) -> Any:
    from common.model.config import ModelConfig
    from services.router.gguf_meta import read_metadata
    from services.router.tokenizer import resolve_gguf

    meta = read_metadata(resolve_gguf(model))
    arch = meta.get("general.architecture", "llama")
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        name=model, vocab_size=int(g("vocab_size")), hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
        num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("rope.dimension_count", hidden // heads)),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=None,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings=True,  # tensors are not read; SmolLM2 ties them
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else ())


def make_block_hasher(config: ClusterConfig) -> Callable[[list[int]], list[str]]:
    """``token_ids → [hex key of each full block]`` for this cluster's model."""
    from common.kv.block_keys import compute_block_keys, model_fingerprint

    model_config = _engine_model_config(config.model)
    if model_config is None:
        model_config = _gguf_model_config(config.model)
    fingerprint = model_fingerprint(model_config)
    block_size = config.block_size

    def block_keys(token_ids: list[int]) -> list[str]:
        return [k.hex() for k in compute_block_keys(token_ids, block_size, fingerprint)]

    return block_keys
