"""Read a GGUF file (llama.cpp's format): config, weights (HF names), tokenizer.

A GGUF is read as the HF checkpoint llama.cpp's convert script made it from, so that the
families of common/model/arch.py serve it exactly as they serve a directory:

- ``hf_config`` rebuilds config.json from the file's metadata, with the values llama.cpp
  does not store but fixes per architecture (``llama_model_load_hparams``): Gemma 2's
  every other layer sliding and Gemma 3's five in six with a RoPE base of 10,000, and the
  query scale (1/sqrt(hidden / heads) for the 27B models, 1/sqrt(head_dim) otherwise);
  ``config_from_hf`` then reads it as any config.json. A mixture of experts' settings
  come from its ``expert_*`` keys (a "llama" file with experts is a Mixtral).
- ``read_weights`` names each tensor by gguf's own table of HF to GGUF names
  (``gguf.get_tensor_name_map``) and undoes what the convert script did to it: the
  permuted rows of LLaMA's attn_q / attn_k (llama.cpp's interleaved RoPE), and the 1 it
  added to every Gemma norm. A layer's experts, stacked in one tensor
  (``ffn_gate_exps``: [experts, rows, columns]), are split into each expert's weight.
  ``check_weights`` refuses a tensor the family does not read.
  A quantized matrix stays as the file holds it (common/model/quant.py), the rest is
  dequantized to float32.
- ``read_lora`` reads llama.cpp's LoRA adapter GGUF (convert_lora_to_gguf.py's) as the
  PEFT directory it was made from (common/model/lora.py serves it).
- The tokenizer is transformers' reading of the file's vocabulary; a turn ends at the
  file's end-of-sequence, end-of-turn and end-of-message ids and at the tokens llama.cpp
  ends generation on by their text (``END_OF_GENERATION``): a Gemma file names ``<eos>``
  only, and its answers end with ``<end_of_turn>``.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from common.model.arch import UnsupportedModelError, config_from_hf
from common.model.config import ModelConfig
from common.model.lora import AdapterError
from common.model.quant import QuantizedWeight, from_gguf
from common.model.weights import check_weights, weight_shapes

# general.architecture -> the HF architecture whose family serves it. The convert script
# writes a Mistral as "llama", without its sliding window; "mistral" is older files' name.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "olmoe": "OlmoeForCausalLM"}
# a "llama" file with experts is a Mixtral; whether llama.cpp renormalizes the chosen
# experts' probabilities where the file does not say (``expert_weights_norm``)
_MIXTURE_ARCH = {"llama": "MixtralForCausalLM", "mistral": "MixtralForCausalLM"}
_NORMALIZED_EXPERTS = {"llama": True, "mistral": True, "qwen2moe": False, "qwen3moe": True,
                       "olmoe": False}
_LLAMA_ROWS = ("llama", "mistral")  # files whose q/k rows the convert script permuted
# gguf's name table for each (a "mistral" file uses LLaMA's tensor names)
_NAME_TABLE = {"mistral": "llama"}
# llama.cpp's layer count of the 27B Gemmas, whose query scale is 1/sqrt(hidden / heads)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# the texts llama.cpp ends generation on wherever the vocabulary has them (llama-vocab.cpp)
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                     "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")
ROPE_FREQS = "model.rope_freqs"  # llama.cpp's per-frequency factors (llama3 files)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf permute() on rows of a q/k weight."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _architecture(reader: Any) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (supported: "
                                    f"{', '.join(ARCHITECTURES)})")
    return arch


def _rope_scaling(reader: Any, arch: str) -> Optional[dict]:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind,
                               "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    if kind == "yarn":
        for key in ("beta_fast", "beta_slow"):
            value = _field(reader, f"{arch}.rope.scaling.yarn_{key}")
            if value is not None:
                scaling[key] = float(value)
        for key in ("attn_factor", "yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier"):
            if f"{arch}.rope.scaling.{key}" in reader.fields:  # llama.cpp's own terms
                raise UnsupportedModelError(f"GGUF YaRN with {arch}.rope.scaling.{key}: "
                                            "not supported")
    return scaling


def end_of_generation(reader: Any) -> list[int]:
    """The ids a turn ends at, the file's end-of-sequence first (see the module's doc)."""
    ids = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        texts = tokens.contents()
        ids += [i for i, text in enumerate(texts) if text in END_OF_GENERATION]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def hf_config(reader: Any) -> dict[str, Any]:
    """The config.json the file was converted from, as far as it decides the model."""
    arch = _architecture(reader)

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if isinstance(value, list):  # per-layer values (head counts of hybrid models)
            raise UnsupportedModelError(f"GGUF {arch}.{key} differs by layer: not supported")
        return value

    tensors = {t.name for t in reader.tensors}
    heads, hidden = int(meta("attention.head_count")), int(meta("embedding_length"))
    layers = int(meta("block_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    rotated = meta("rope.dimension_count")
    if rotated is not None and int(rotated) != head_dim:
        raise UnsupportedModelError(f"GGUF rotates {rotated} of each head's {head_dim} "
                                    "dimensions (partial RoPE): not supported")
    vocab = meta("vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]], "vocab_size": int(vocab),
        "hidden_size": hidden, "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)), "head_dim": head_dim,
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": end_of_generation(reader),
    }
    if ARCHITECTURES[arch] == "LlamaForCausalLM":
        d["attention_bias"] = "blk.0.attn_q.bias" in tensors
        d["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    experts = int(meta("expert_count", 0))
    if experts:
        if arch in _MIXTURE_ARCH:
            d["architectures"] = [_MIXTURE_ARCH[arch]]
        d.update(num_experts=experts, num_experts_per_tok=int(meta("expert_used_count")),
                 moe_intermediate_size=int(meta("expert_feed_forward_length",
                                                d["intermediate_size"])),
                 shared_expert_intermediate_size=int(
                     meta("expert_shared_feed_forward_length", 0)),
                 norm_topk_prob=bool(meta("expert_weights_norm", _NORMALIZED_EXPERTS[arch])))
    if arch in _GEMMA_27B_LAYERS:
        big = layers == _GEMMA_27B_LAYERS[arch]
        d["query_pre_attn_scalar"] = hidden // heads if big else head_dim
        d["final_logit_softcapping"] = meta("final_logit_softcapping")
    window = meta("attention.sliding_window")
    if arch == "gemma2":
        d["attn_logit_softcapping"] = meta("attn_logit_softcapping")
        d["sliding_window"] = window  # every other layer (arch.py), llama.cpp's pattern 2
    elif arch == "gemma3":
        d["rope_local_base_freq"] = float(meta("rope.freq_base_swa", 10000.0))
        if window:  # five layers in six slide (arch.py), llama.cpp's pattern 6
            d["sliding_window"] = window
        else:
            d["layer_types"] = ["full_attention"] * layers
    return d


def read_config(reader: Any, name: str, path: str) -> ModelConfig:
    from common.model.loader import weights_id

    return config_from_hf(hf_config(reader), name, weights_id([path]))


def _hf_names(arch: str, config: ModelConfig) -> dict[str, list[str]]:
    """GGUF tensor name -> the HF names it holds, for every weight the family reads: one,
    or each expert's in order, where the file stacks a layer's experts in one tensor
    (``blk.N.ffn_gate_exps``: [experts, rows, columns])."""
    import gguf

    arch = _NAME_TABLE.get(arch, arch)
    index = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    table = gguf.get_tensor_name_map(index, config.num_layers)
    names: dict[str, list[str]] = {}
    for hf in weight_shapes(config):
        base, _, suffix = hf.rpartition(".")
        gguf_name = table.get_name(_EXPERT_INDEX.sub(".experts.", base))
        if gguf_name is not None:
            names.setdefault(f"{gguf_name}.{suffix}", []).append(hf)
    return names


_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")
_SPLIT_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|down|up)\.\d+\.weight")  # before 2024


def _parts(name: str, hf: list[str], shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """Each HF weight of a GGUF tensor of ``shape`` with its shape: the experts of a
    stacked one, one by one; a 1-D shared expert gate as the [1, hidden] it was."""
    if len(hf) > 1:
        if len(shape) != 3 or shape[0] != len(hf):
            raise UnsupportedModelError(f"GGUF tensor {name!r} of shape {shape} does not "
                                        f"stack {len(hf)} experts")
        return [(n, shape[1:]) for n in hf]
    if hf[0].endswith("shared_expert_gate.weight") and len(shape) == 1:
        return [(hf[0], (1, *shape))]
    return [(hf[0], shape)]


def read_weights(reader: Any, config: ModelConfig
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Each model tensor in its HF name and layout, one at a time: a matrix of a type
    common/model/quant.py takes as it is quantized (``QuantizedWeight``), any other
    tensor dequantized to float32 (a model's float32 copy need never be in memory at
    once). Every name and shape is checked (``check_weights``) before the first is read."""
    from gguf.quants import dequantize

    arch = _architecture(reader)
    names = _hf_names(arch, config)
    parts: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        if t.name == "rope_freqs.weight":
            parts[t.name] = [(ROPE_FREQS, shape)]
        elif t.name in names:
            parts[t.name] = _parts(t.name, names[t.name], shape)
        elif _SPLIT_EXPERT.fullmatch(t.name):
            raise UnsupportedModelError(
                f"GGUF tensor {t.name!r}: an older Mixtral file, each expert its own tensor, "
                "which llama.cpp no longer reads either: use a file converted since 2024 "
                "(experts stacked in blk.N.ffn_gate_exps)")
        else:
            raise UnsupportedModelError(f"GGUF tensor {t.name!r} is not a weight this model "
                                        "reads: refusing to ignore it")
    check_weights(config, {name: torch.empty(shape, device="meta")
                           for t in reader.tensors if t.name != "rope_freqs.weight"
                           for name, shape in parts[t.name]})
    llama = arch in _LLAMA_ROWS
    gemma = arch in _GEMMA_27B_LAYERS
    for t in reader.tensors:
        heads = (config.num_heads if t.name.endswith("attn_q.weight") else config.num_kv_heads
                 if t.name.endswith("attn_k.weight") else None) if llama else None
        shape = tuple(int(n) for n in reversed(t.shape))
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 0
        quantized = (from_gguf(t.data, t.tensor_type.name, (rows, shape[-1]))
                     if len(shape) > 1 else None)
        if quantized is not None:
            if heads is not None:  # the same permutation of whole rows
                order = unpermute_qk(np.arange(shape[0]), heads)
                quantized = quantized.rows(torch.from_numpy(order))
            each = rows // len(parts[t.name])  # an expert's rows of a stacked tensor
            for i, (name, _) in enumerate(parts[t.name]):
                yield name, (quantized.rows(slice(i * each, (i + 1) * each))
                             if len(parts[t.name]) > 1 else quantized)
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if heads is not None:
            w = unpermute_qk(w, heads)
        elif gemma and parts[t.name][0][0].endswith("norm.weight"):
            w = w - 1.0  # the convert script stored Gemma's 1 + weight
        stacked = len(parts[t.name]) > 1
        for i, (name, part_shape) in enumerate(parts[t.name]):
            part = w[i] if stacked else w.reshape(part_shape)
            yield name, torch.from_numpy(np.array(part, dtype=np.float32, order="C"))


def read_lora(path: Path, config: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """A LoRA adapter in llama.cpp's GGUF (``convert_lora_to_gguf.py``: ``general.type``
    "adapter", ``adapter.type`` "lora", ``adapter.lora.alpha``, each linear's
    ``<tensor>.lora_a`` [r, in] and ``.lora_b`` [out, r]) in PEFT's names and layout: B's
    rows of a LLaMA file's q and k un-permuted as the model's own (the convert script
    permutes them with the model's), its scale llama.cpp's (alpha / r: the script keeps
    no rsLoRA or per-module alpha). Other tensors (a mergekit adapter's norms, embeddings)
    are refused."""
    import gguf
    from gguf.quants import dequantize

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise AdapterError(f"{path}: unreadable GGUF ({exc})") from None

    def field(key: str) -> Any:
        return _field(reader, key)

    if (field("general.type"), field("adapter.type")) != ("adapter", "lora"):
        raise AdapterError(f"{path}: not a LoRA adapter GGUF (general.type "
                           f"{field('general.type')!r}, adapter.type {field('adapter.type')!r})")
    if field("adapter.alora.invocation_tokens") is not None:
        raise AdapterError(f"{path}: activated LoRA (aLoRA) is not supported")
    arch = str(field("general.architecture"))
    try:
        names = {g: hf[0] for g, hf in _hf_names(arch, config).items()}
    except (KeyError, UnsupportedModelError) as exc:
        raise AdapterError(f"{path}: architecture {arch!r} is not one served ({exc})") from None
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        base, _, part = t.name.rpartition(".")
        if part not in ("lora_a", "lora_b") or base not in names:
            raise AdapterError(f"{path}: tensor {t.name!r} is not a LoRA update of a weight "
                               "this model reads")
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape(tuple(int(n) for n in reversed(t.shape)))
        heads = (config.num_heads if base.endswith("attn_q.weight") else config.num_kv_heads
                 if base.endswith("attn_k.weight") else None)
        if part == "lora_b" and heads is not None and arch in _LLAMA_ROWS:
            w = unpermute_qk(w, heads)
        hf = names[base].removesuffix(".weight")
        tensors[f"base_model.model.{hf}.lora_{part[-1].upper()}.weight"] = \
            torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    alpha = field("adapter.lora.alpha")
    return {"peft_type": "LORA", "lora_alpha": float(alpha) if alpha else None}, tensors


def read_tokenizer(path: str, reader: Any) -> dict[str, Any]:
    """Tokenizer spec: tokenizer.json text, special tokens, chat template (from GGUF metadata)."""
    from transformers.integrations.gguf import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

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


def load_gguf(path: str) -> tuple[ModelConfig,
                                  Iterator[tuple[str, torch.Tensor | QuantizedWeight]],
                                   dict[str, Any]]:
    """(config, its tensors one at a time, tokenizer spec) of the file at ``path``."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    name = os.path.basename(path).removesuffix(".gguf")
    config = read_config(reader, name, path)
    return config, read_weights(reader, config), read_tokenizer(path, reader)
