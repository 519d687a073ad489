"""GGUF files made from the tiny HF checkpoints of tiny_checkpoints.py as llama.cpp's
convert_hf_to_gguf.py makes them: its metadata keys, gguf's own table of tensor names,
LLaMA's q/k rows permuted for llama.cpp's interleaved RoPE, Gemma's norms stored as
1 + weight, no LM head where the embeddings are tied, and a byte-level BPE vocabulary as a
"gpt2" tokenizer (token list, types, merges, special ids, chat template). Tensors stay
float32, so a model read from the file can be held to transformers' logits on the
directory.

What llama.cpp fixes per architecture instead of storing (Gemma's sliding pattern, the
local RoPE base, the query scale) is asserted of the checkpoint: a file cannot say more.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np

from tests.model.tiny_checkpoints import SMALL

WINDOW = 8  # tokens: the tests' prompts are 2-6 windows long
_GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
# GGUF architecture -> (transformers' model_type, its config beyond SMALL, chat kind, the
# end-of-sequence token the file names). Gemma's heads are wider than hidden / heads, so
# that its query scale (1/sqrt(head_dim) below 27B, llama.cpp's rule) is not that too.
FAMILIES = {
    "llama": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 5000.0}}, "qwen", None),
    "qwen2": ("qwen2", {}, "qwen", None),
    "qwen3": ("qwen3", {"tie_word_embeddings": True}, "qwen", None),
    "gemma2": ("gemma2", {"sliding_window": WINDOW, "head_dim": 24, "query_pre_attn_scalar": 24,
                          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
               "gemma", "<eos>"),
    "gemma3": ("gemma3_text", {"num_hidden_layers": 6, "sliding_window": WINDOW,
                               "head_dim": 24, "query_pre_attn_scalar": 24,
                               "final_logit_softcapping": 3.0,
                               "rope_parameters": _GEMMA3_ROPE}, "gemma", "<eos>"),
    # mixtures of experts, their experts stacked a layer in one tensor (ffn_gate_exps)
    "mixtral": ("mixtral", {"num_local_experts": 6, "num_experts_per_tok": 2,
                            "intermediate_size": 32}, "qwen", None),
    "qwen2moe": ("qwen2_moe", {"num_experts": 6, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 32,
                               "shared_expert_intermediate_size": 48}, "qwen", None),
    "qwen3moe": ("qwen3_moe", {"num_experts": 6, "num_experts_per_tok": 3,
                               "moe_intermediate_size": 32, "norm_topk_prob": True},
                 "qwen", None),
    "olmoe": ("olmoe", {"num_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 32},
              "qwen", None),
}
GGUF_ARCH = {"mixtral": "llama"}  # the convert script writes a Mixtral as "llama"
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


# llama.cpp's token types (gguf.TokenType)
_NORMAL, _CONTROL, _UNUSED = 1, 3, 5


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (rotate-half rows -> interleaved pairs)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _rope(config: dict[str, Any]) -> tuple[dict, Optional[dict]]:
    """(the full-attention layers' RoPE parameters, the sliding layers')."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        return params["full_attention"], params.get("sliding_attention")
    return params, None


def _check_llama_cpp_fixes(arch: str, config: dict[str, Any]) -> None:
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    pattern = {"gemma2": 2, "gemma3": 6}.get(arch)
    if pattern:
        slides = ["sliding_attention" if i % pattern < pattern - 1 else "full_attention"
                  for i in range(layers)]
        assert config["layer_types"] == slides, "llama.cpp slides a fixed pattern"
        assert config["query_pre_attn_scalar"] == head_dim, "llama.cpp's scale below 27B"
    if arch == "gemma3":
        local = _rope(config)[1] or {}
        assert local.get("rope_theta") == 10000.0 and local.get("rope_type") == "default"


def write_gguf(hf_dir: Path, path: Path, arch: str, *, eos_token: Optional[str] = None,
               head_dim_rotated: Optional[int] = None, extra_tensor: Optional[str] = None,
               matrices: str = "F32") -> Path:
    """``hf_dir`` as llama.cpp's convert script writes it, architecture ``arch``, its
    end-of-sequence token ``eos_token`` (tokenizer_config.json's by default: a Gemma file
    names ``<eos>``), its matrices of GGML type ``matrices`` (quantized as llama.cpp's
    quantize rounds them: Q8_0, Q4_0, ...); ``head_dim_rotated`` and ``extra_tensor`` make
    files Crescent must refuse."""
    import gguf
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    _check_llama_cpp_fixes(arch, config)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    full, _ = _rope(config)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type", "default") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if arch == "llama" or head_dim_rotated is not None:
        w.add_rope_dimension_count(head_dim_rotated or config["head_dim"])
    if arch.startswith("gemma"):
        w.add_sliding_window(config["sliding_window"])
        if config.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    _add_tokenizer(w, hf_dir, config["vocab_size"], eos_token)

    table = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch],
                                     config["num_hidden_layers"])
    tensors = load_file(str(hf_dir / "model.safetensors"))
    for name, tensor in _stack_experts(tensors).items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        base, _, suffix = name.rpartition(".")
        data = tensor.astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = _permute(data, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = _permute(data, kv_heads)
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1.0
        data = np.ascontiguousarray(data)
        if matrices != "F32" and data.ndim >= 2 and not base.endswith("gate"):  # routers stay
            kind = gguf.GGMLQuantizationType[matrices]
            w.add_tensor(f"{table.get_name(base)}.{suffix}", quantize(data, kind),
                         raw_dtype=kind)
        else:
            w.add_tensor(f"{table.get_name(base)}.{suffix}", data)
    if extra_tensor:
        w.add_tensor(extra_tensor, np.ones(config["hidden_size"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer's experts' weights of one kind as one [experts, rows, columns] tensor
    named without the index (``mlp.experts.gate_proj.weight``), as the convert script
    merges them."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in tensors.items():
        found = _EXPERT.search(name)
        if found is None:
            out[name] = tensor
        else:
            stacks.setdefault(_EXPERT.sub(".experts.", name), {})[int(found.group(1))] = tensor
    for name, by_index in stacks.items():
        out[name] = np.stack([by_index[i] for i in range(len(by_index))])
    return out


def _add_tokenizer(w: Any, hf_dir: Path, vocab_size: int, eos_token: Optional[str]) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    specials = {t["content"]: t["id"] for t in tok["added_tokens"] if t["special"]}
    texts = {i: t for t, i in tok["model"]["vocab"].items()} | {i: t for t, i in specials.items()}
    tokens = [texts.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [_CONTROL if t in specials else _NORMAL if i in texts else _UNUSED
             for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_add_bos_token(bool(tok_config.get("add_bos_token")))
    w.add_eos_token_id(specials[eos_token or tok_config["eos_token"]])
    if tok_config.get("bos_token"):
        w.add_bos_token_id(specials[tok_config["bos_token"]])
    w.add_chat_template(tok_config["chat_template"])


def write_family(arch: str, path: Path, **case: Any) -> tuple[Any, dict[str, int], Path]:
    """A tiny checkpoint of ``FAMILIES[arch]`` with its chat tokenizer in ``path``, and its
    GGUF ``<arch>-tiny.gguf`` beside it (``case``: write_gguf's refusals, or a
    ``max_position_embeddings``): (transformers' model, the special tokens' ids, the
    GGUF's path)."""
    from tests.model.tiny_checkpoints import write_chat_tokenizer, write_checkpoint

    model_type, config, chat, eos_token = FAMILIES[arch]
    config = {**config, **{k: case.pop(k) for k in list(case) if k in SMALL}}
    hf = write_checkpoint(model_type, path, **config)
    specials = write_chat_tokenizer(path, chat)
    return hf, specials, write_gguf(path, path / f"{arch}-tiny.gguf", GGUF_ARCH.get(arch, arch),
                                    eos_token=eos_token, **case)
