"""The decoder families Crescent serves, and how each differs from LLaMA: one description
per HF ``architectures`` value, which the model (common/model/decoder.py) reads.

Every family here is LLaMA's layer (a pre-norm, RoPE, grouped-query attention, a gated
MLP) with a few changes, so each is a ``Family`` of switches, and the numbers (biases, the
sliding window and which layers slide, the attention scale, soft-capping, a second RoPE
base) are read from config.json into ``ModelConfig`` by ``config_from_hf``:

| architecture | differs from LLaMA by |
|---|---|
| LlamaForCausalLM, MistralForCausalLM | nothing (Mistral: a sliding window on every layer) |
| Qwen2ForCausalLM | biases on q/k/v; a window on the layers from ``max_window_layers`` |
| Qwen3ForCausalLM | an RMSNorm of each head's q and k before RoPE |
| Gemma2ForCausalLM | norms scale by 1 + weight; the attention and MLP outputs are normed before the residual add; GELU (tanh); embeddings times sqrt(hidden); the query scale; soft-capped scores and logits; every other layer slides |
| Gemma3ForCausalLM | Gemma2's, less the soft-capping, plus Qwen3's q/k norms; 5 layers of 6 slide, with their own RoPE base |
| MixtralForCausalLM | Mistral's, with a mixture of experts for the MLP (``block_sparse_moe``: w1, w3, w2) |
| Qwen2MoeForCausalLM | Qwen2's, with a mixture of experts and a shared expert (``mlp``) |
| Qwen3MoeForCausalLM | Qwen3's, with a mixture of experts (``mlp``) |
| OlmoeForCausalLM | an RMSNorm of the whole q and k projections before RoPE; a mixture of experts (``mlp``) |
| DeepseekV2ForCausalLM | latent attention and, from the ``first_k_dense_replace``-th layer, a mixture with shared experts and V2's router (softmax scores, greedy or group-limited, a scaling) |
| DeepseekV3ForCausalLM | latent attention (``ModelConfig.kv_lora_rank``); from the ``first_k_dense_replace``-th layer a mixture with shared experts and DeepSeek's router (sigmoid scores, a choice bias, expert groups, a scaling) |

Anything else is refused by name (``UnsupportedModelError``), and so is a checkpoint with
a weight the family does not read (common/model/weights.py ``check_weights``): no weight
is silently ignored.
The KV layout is every family's: [layers, K/V, heads, head_dim] per token.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from common.model.config import ModelConfig


class UnsupportedModelError(ValueError):
    """A checkpoint Crescent cannot serve correctly: an unknown architecture, setting or
    weight. Raised at start, with one line naming what."""


@dataclass(frozen=True)
class ExpertNames:
    """Where a mixture's weights are, under ``model.layers.N.``: ``{block}.gate`` routes,
    ``{block}.experts.E.{gate|up|down}`` are expert E's gated MLP."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str = "shared_expert"  # ``{block}.{shared}``: the shared expert, if any
    shared_gate: Optional[str] = "shared_expert_gate"  # its sigmoid gate; None: ungated


@dataclass(frozen=True)
class Family:
    # The weight names of a layer's norms (under ``model.layers.N.``):
    # ``mlp_norm`` before the MLP (LLaMA's post_attention_layernorm); Gemma's
    # ``attn_out_norm``/``mlp_out_norm`` norm the attention's and the MLP's outputs.
    norms: Mapping[str, str] = field(default_factory=lambda: {
        "mlp_norm": "post_attention_layernorm"})
    norm_offset: float = 0.0     # Gemma stores weight - 1: its norms scale by 1 + weight
    # q_norm / k_norm before RoPE: over each head's q and k ("head"), or over the whole
    # q and k projections ("projection": OLMoE)
    qk_norm: str = ""
    embed_scale: bool = False    # embeddings times sqrt(hidden_size)
    default_activation: str = "silu"
    activation_key: str = "hidden_act"
    default_tied: bool = False
    qkv_bias: bool = False       # q/k/v have biases whatever ``attention_bias`` says (Qwen2)
    experts: Optional[ExpertNames] = None  # a mixture of experts' weight names
    latent: bool = False  # multi-head latent attention (DeepSeek)


_GEMMA_NORMS = {"attn_out_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm",
                "mlp_out_norm": "post_feedforward_layernorm"}
_GEMMA = dict(norms=_GEMMA_NORMS, norm_offset=1.0, embed_scale=True,
              default_activation="gelu_pytorch_tanh", activation_key="hidden_activation",
              default_tied=True)

_DEEPSEEK = Family(experts=ExpertNames(shared="shared_experts", shared_gate=None), latent=True)

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(qkv_bias=True),
    "Qwen3ForCausalLM": Family(qk_norm="head"),
    "Gemma2ForCausalLM": Family(**_GEMMA),
    "Gemma3ForCausalLM": Family(qk_norm="head", **_GEMMA),
    "MixtralForCausalLM": Family(experts=ExpertNames("block_sparse_moe", "w1", "w3", "w2")),
    "Qwen2MoeForCausalLM": Family(qkv_bias=True, experts=ExpertNames()),
    "Qwen3MoeForCausalLM": Family(qk_norm="head", experts=ExpertNames()),
    "OlmoeForCausalLM": Family(qk_norm="projection", experts=ExpertNames()),
    "DeepseekV2ForCausalLM": _DEEPSEEK,
    "DeepseekV3ForCausalLM": _DEEPSEEK,
}
# config.json's model_type, for checkpoints that do not name their architecture
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                  "deepseek_v2": "DeepseekV2ForCausalLM",
                  "deepseek_v3": "DeepseekV3ForCausalLM"}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def family(config: ModelConfig) -> Family:
    return FAMILIES[config.architecture]


def architecture_of(d: Mapping[str, Any]) -> str:
    names = d.get("architectures") or []
    if len(names) > 1:
        raise UnsupportedModelError(f"config.json names several architectures {names}")
    name = names[0] if names else _BY_MODEL_TYPE.get(d.get("model_type", ""))
    if name not in FAMILIES:
        shown = name or f"model_type {d.get('model_type')!r}"
        raise UnsupportedModelError(f"architecture {shown} is not supported (supported: "
                                    f"{', '.join(FAMILIES)})")
    return name


def config_from_hf(d: Mapping[str, Any], name: str, weights_id: str = "") -> ModelConfig:
    """ModelConfig from a HF config.json dict (transformers 4 or 5 field names)."""
    arch = architecture_of(d)
    fam = FAMILIES[arch]
    if d.get("clip_qkv"):
        raise UnsupportedModelError(f"{arch} with clip_qkv is not supported")
    if d.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{arch} with use_bidirectional_attention (an encoder) "
                                    "is not supported")
    act = d.get(fam.activation_key) or fam.default_activation
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{arch} with activation {act!r} is not supported "
                                    f"({', '.join(ACTIVATIONS)})")
    layers = d["num_hidden_layers"]
    heads = d["num_attention_heads"]
    global_rope, local_rope = (_yarn_lengths(r, d) for r in _rope(d, arch))
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    attention_bias = bool(d.get("attention_bias", False))
    window = d.get("sliding_window")
    sliding = tuple(i for i in range(layers) if _slides(d, arch, i))
    gemma = fam.norm_offset != 0.0
    config = ModelConfig(
        name=name, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_layers=layers,
        num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rope_theta=global_rope[0], rope_scaling=global_rope[1],
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", fam.default_tied)),
        bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids,
        architecture=arch,
        qkv_bias=attention_bias or fam.qkv_bias, o_bias=attention_bias,
        mlp_bias=bool(d.get("mlp_bias", False)), activation=ACTIVATIONS[act],
        sliding_window=int(window) if window and sliding else None,
        sliding_layers=sliding if window or local_rope else (),
        query_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        attn_softcap=d.get("attn_logit_softcapping") if gemma else None,
        final_softcap=d.get("final_logit_softcapping") if gemma else None,
        local_rope_theta=local_rope[0] if local_rope else None,
        local_rope_scaling=local_rope[1] if local_rope else None,
        weights_id=weights_id)
    extra = {**(_mixture(d, arch, layers) if fam.experts else {}),
             **(_latent(d, global_rope[1]) if fam.latent else {})}
    return dataclasses.replace(config, **extra) if extra else config


def _deepseek_router(d: Mapping[str, Any], v3: bool, experts: int, layers: int
                     ) -> dict[str, Any]:
    """DeepSeek's mixture fields, as transformers routes: V3 by sigmoid scores with a
    choice bias, in groups scored by their two best, renormalized (``norm_topk_prob``);
    V2 by softmax scores, greedily or (``group_limited_greedy``) in groups scored by
    their best, never renormalized; both scaled by ``routed_scaling_factor``."""
    method = d.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    grouped = v3 or method == "group_limited_greedy"
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModelError(f"DeepSeek V2 topk_method {method!r} is not supported")
    groups = int(d.get("n_group") or 1) if grouped else 1
    if experts % groups:
        raise UnsupportedModelError(f"{experts} experts in {groups} groups")
    return dict(num_experts=int(experts), experts_per_token=int(d["num_experts_per_tok"]),
                expert_intermediate_size=int(d["moe_intermediate_size"]),
                normalize_experts=bool(d.get("norm_topk_prob", True)) if v3 else False,
                shared_expert_intermediate_size=int(
                    d["moe_intermediate_size"] * (d.get("n_shared_experts") or 0)),
                dense_layers=tuple(range(min(layers, d.get("first_k_dense_replace",
                                                           3 if v3 else 0)))),
                router_scoring="sigmoid" if v3 else "softmax", router_bias=v3,
                expert_groups=groups,
                expert_groups_per_token=int(d.get("topk_group") or 1) if grouped else 1,
                expert_group_score=2 if v3 else 1,
                routed_scaling=float(d.get("routed_scaling_factor", 1.0)))


def _latent(d: Mapping[str, Any], scaling: Optional[dict]) -> dict[str, Any]:
    """Latent attention's ``ModelConfig`` fields (DeepSeek), which also set the KV
    cache's head (one: the latent and the rotated key, common/model/latent.py) and the
    query scale (1/sqrt of a head's q width; YaRN's ``mscale_all_dim`` squared, as
    transformers' ``yarn_apply_mscale``)."""
    from common.model.rope import attention_factor

    if d.get("attention_bias"):
        raise UnsupportedModelError("latent attention with attention_bias is not supported")
    nope, rope = int(d["qk_nope_head_dim"]), int(d["qk_rope_head_dim"])
    if attention_factor(scaling) != 1.0:  # it would scale the rotated part's q . k only
        raise UnsupportedModelError("latent attention with a YaRN whose mscale differs from "
                                    "its mscale_all_dim is not supported")
    scale = (nope + rope) ** -0.5
    if scaling and scaling.get("mscale_all_dim") and float(scaling.get("factor", 1)) > 1:
        scale *= (0.1 * float(scaling["mscale_all_dim"]) * math.log(scaling["factor"]) + 1) ** 2
    rank = int(d["kv_lora_rank"])
    return dict(q_lora_rank=int(d.get("q_lora_rank") or 0), kv_lora_rank=rank,
                qk_nope_head_dim=nope, v_head_dim=int(d["v_head_dim"]), rope_dim=rope,
                rope_interleaved=bool(d.get("rope_interleave", True)),
                head_dim=rank + rope, num_kv_heads=1, query_scale=scale)


def _mixture(d: Mapping[str, Any], arch: str, layers: int) -> dict[str, Any]:
    """A mixture's ``ModelConfig`` fields: Mixtral's every layer, Qwen's every
    ``decoder_sparse_step``-th but ``mlp_only_layers``, DeepSeek's from the
    ``first_k_dense_replace``-th, as transformers builds them."""
    experts = (d.get("num_local_experts") or d.get("num_experts") or d.get("n_routed_experts")
               or 0)
    if arch == "MixtralForCausalLM":
        dense: tuple[int, ...] = ()
        size, normalize = d["intermediate_size"], True
    elif arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return _deepseek_router(d, arch == "DeepseekV3ForCausalLM", experts, layers)
    else:
        step, only = d.get("decoder_sparse_step", 1), set(d.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(layers)
                      if i in only or not (experts > 0 and (i + 1) % step == 0))
        size = d.get("moe_intermediate_size") or d["intermediate_size"]  # OLMoE: the latter
        normalize = bool(d.get("norm_topk_prob", False))
    return dict(num_experts=int(experts), experts_per_token=int(d["num_experts_per_tok"]),
                expert_intermediate_size=int(size), normalize_experts=normalize,
                shared_expert_intermediate_size=int(
                    d.get("shared_expert_intermediate_size") or 0),
                dense_layers=dense)


def _slides(d: Mapping[str, Any], arch: str, layer: int) -> bool:
    """Whether ``layer`` is a sliding one (its window may be None: then it differs only
    by its RoPE base, where the family has one)."""
    types = d.get("layer_types")
    if types:
        return types[layer] == "sliding_attention"
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return bool(d.get("use_sliding_window")) and layer >= d.get("max_window_layers", 28)
    if arch == "Qwen2MoeForCausalLM":  # transformers 5's layer_types, when it wrote none
        return (bool(d.get("use_sliding_window")) and bool((layer + 1) % 2)
                and layer < d.get("max_window_layers", 28))
    if arch == "Qwen3MoeForCausalLM":
        return bool(d.get("use_sliding_window"))
    if arch == "Gemma2ForCausalLM":
        return layer % 2 == 0
    if arch == "Gemma3ForCausalLM":
        return bool((layer + 1) % d.get("sliding_window_pattern", 6))
    return True  # Mistral: every layer


Rope = tuple[float, Optional[dict]]  # (base, scaling: rope_type and its parameters)
_LOCAL_THETA_DEFAULT, _GEMMA3_THETA_DEFAULT = 10_000.0, 1_000_000.0


def _rope(d: Mapping[str, Any], arch: str) -> tuple[Rope, Optional[Rope]]:
    """(the RoPE of full-attention layers, that of sliding layers where it differs)."""
    params = d.get("rope_parameters")
    gemma3 = arch == "Gemma3ForCausalLM"
    if params and "full_attention" in params:  # transformers 5: per layer type
        full = _rope_of(params["full_attention"], d.get("rope_theta"))
        local = _rope_of(params.get("sliding_attention") or {}, _LOCAL_THETA_DEFAULT)
        return full, local
    default_theta = _GEMMA3_THETA_DEFAULT if gemma3 else 10000.0
    if params:
        full = _rope_of(params, d.get("rope_theta", default_theta))
    else:
        full = _rope_of(d.get("rope_scaling") or {}, d.get("rope_theta", default_theta))
    if gemma3:  # transformers 4: the local base beside the global one
        return full, (float(d.get("rope_local_base_freq", _LOCAL_THETA_DEFAULT)), None)
    return full, None


def _yarn_lengths(rope: Optional[Rope], d: Mapping[str, Any]) -> Optional[Rope]:
    """A YaRN scaling with the pretraining length it extends, as transformers completes
    it: config.json's top-level ``original_max_position_embeddings`` first (Phi-3 keeps
    it there), else the scaling's, else ``max_position_embeddings``."""
    if rope is None or (rope[1] or {}).get("rope_type", (rope[1] or {}).get("type")) != "yarn":
        return rope
    scaling = dict(rope[1])
    if scaling.get("factor") is None:
        raise UnsupportedModelError("rope scaling 'yarn' without a factor")
    scaling["original_max_position_embeddings"] = (
        d.get("original_max_position_embeddings")
        or scaling.get("original_max_position_embeddings")
        or d.get("max_position_embeddings", 2048))
    return rope[0], scaling


def _rope_of(p: Mapping[str, Any], theta: Optional[float]) -> Rope:
    from common.model.rope import SUPPORTED_ROPE_TYPES

    theta = p.get("rope_theta", theta)
    kind = p.get("rope_type", p.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported "
                                    f"({', '.join(SUPPORTED_ROPE_TYPES)})")
    scaling = None if kind == "default" else {k: v for k, v in p.items() if k != "rope_theta"}
    return float(theta if theta is not None else 10000.0), scaling
