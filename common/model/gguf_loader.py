"""Read a llama-architecture GGUF file: config, dequantized weights (HF names), tokenizer.

GGUF quirks handled here: tensor shapes are stored in ggml order (reversed; gguf's reader
already exposes rows-first numpy arrays), and llama.cpp's convert script permutes the rows
of attn_q / attn_k for its interleaved rotary layout; we undo that permutation so the
weights match the HF (rotate-half) layout.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np
import torch

from common.model.arch import UnsupportedModelError
from common.model.config import ModelConfig

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "model.rope_freqs",
}
SUPPORTED_ARCHS = ("llama", "mistral")


def hf_name(gguf_name: str) -> Optional[str]:
    """HF parameter name of a GGUF tensor name (None if not part of the model)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf permute() on rows of a q/k weight."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _rope_scaling(reader: Any, arch: str) -> Optional[dict]:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind,
                               "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


def read_config(reader: Any, name: str, path: str) -> ModelConfig:
    from common.model.loader import weights_id

    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (supported: "
                                    f"{', '.join(SUPPORTED_ARCHS)})")
    tensor_names = {t.name for t in reader.tensors}
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = [_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id")]
    eos_ids = tuple(dict.fromkeys(int(e) for e in eos if e is not None))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        name=name, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")), num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids,
        weights_id=weights_id([path]))


def read_weights(reader: Any, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All model tensors dequantized to float32, in HF names and HF (q/k unpermuted) layout."""
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise UnsupportedModelError(f"GGUF tensor {t.name!r} is not a weight this model "
                                        "reads: refusing to ignore it")
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, config.num_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, config.num_kv_heads)
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    return out


def read_tokenizer(path: str, reader: Any) -> dict[str, Any]:
    """Tokenizer spec: tokenizer.json text, special tokens, chat template (from GGUF metadata)."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    arch, tok_dict, tok_config = get_gguf_tokenizer(path)
    fast, _ = convert_gguf_tokenizer(arch, tok_dict)
    return {
        "tokenizer_json": fast.to_str(),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "bos_token": tok_config.get("bos_token"),
        "eos_token": tok_config.get("eos_token"),
        "add_bos_token": bool(tok_config.get(
            "add_bos_token", _field(reader, "tokenizer.ggml.add_bos_token", False))),
    }


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    name = os.path.basename(path).removesuffix(".gguf")
    config = read_config(reader, name, path)
    return config, read_weights(reader, config), read_tokenizer(path, reader)
