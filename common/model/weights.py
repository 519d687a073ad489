"""Every weight a family (common/model/arch.py) reads, by HF name and shape
(``weight_shapes``: dense, mixture-of-experts and latent-attention layers), and the check
that a checkpoint holds exactly those (``check_weights``): none missing, none of another
shape, none left over to be silently ignored."""
from __future__ import annotations

from typing import Any

from common.model.arch import Family, UnsupportedModelError, family
from common.model.config import ModelConfig

# Names a checkpoint may hold that are not weights: recomputed buffers
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the family reads, in HF names, with its shape."""
    fam = family(config)
    d, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, d),
                                          "model.norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    attention = {"self_attn.q_proj": (q, d, config.qkv_bias),
                 "self_attn.k_proj": (kv, d, config.qkv_bias),
                 "self_attn.v_proj": (kv, d, config.qkv_bias),
                 "self_attn.o_proj": (d, q, config.o_bias)}
    if fam.latent:
        attention = _latent_linears(config)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        mlp = (_mixture_linears(config, fam) if config.sparse(layer)
               else _mlp_linears("mlp", i, d, config.mlp_bias))
        for name, (rows, cols, bias) in {**attention, **mlp}.items():
            shapes[f"{p}{name}.weight"] = (rows, cols)
            if bias:
                shapes[f"{p}{name}.bias"] = (rows,)
        if fam.latent:
            shapes[p + "self_attn.kv_a_layernorm.weight"] = (config.kv_lora_rank,)
            if config.q_lora_rank:
                shapes[p + "self_attn.q_a_layernorm.weight"] = (config.q_lora_rank,)
        if config.sparse(layer) and config.router_bias:
            shapes[p + "mlp.gate.e_score_correction_bias"] = (config.num_experts,)
        for norm in ("input_layernorm", *fam.norms.values()):
            shapes[f"{p}{norm}.weight"] = (d,)
        if fam.qk_norm == "head":
            shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (hd,)
        elif fam.qk_norm == "projection":
            shapes[p + "self_attn.q_norm.weight"] = (q,)
            shapes[p + "self_attn.k_norm.weight"] = (kv,)
    return shapes


def _mlp_linears(prefix: str, inner: int, d: int, bias: bool = False,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 ) -> dict[str, tuple[int, int, bool]]:
    gate, up, down = names
    return {f"{prefix}.{gate}": (inner, d, bias), f"{prefix}.{up}": (inner, d, bias),
            f"{prefix}.{down}": (d, inner, bias)}


def _latent_linears(config: ModelConfig) -> dict[str, tuple[int, int, bool]]:
    """Latent attention's linears (DeepSeek's names)."""
    d, heads, rank = config.hidden_size, config.num_heads, config.kv_lora_rank
    q = heads * (config.qk_nope_head_dim + config.rope_dim)
    linears = ({"self_attn.q_a_proj": (config.q_lora_rank, d, False),
                "self_attn.q_b_proj": (q, config.q_lora_rank, False)} if config.q_lora_rank
               else {"self_attn.q_proj": (q, d, False)})
    return {**linears,
            "self_attn.kv_a_proj_with_mqa": (rank + config.rope_dim, d, False),
            "self_attn.kv_b_proj": (heads * (config.qk_nope_head_dim + config.v_head_dim),
                                    rank, False),
            "self_attn.o_proj": (d, heads * config.v_head_dim, False)}


def _mixture_linears(config: ModelConfig, fam: Family) -> dict[str, tuple[int, int, bool]]:
    """A mixture layer's linears: the router, each expert's, a shared expert's and its
    gate."""
    names, d = fam.experts, config.hidden_size
    assert names is not None
    linears = {f"{names.block}.gate": (config.num_experts, d, False)}
    for e in range(config.num_experts):
        linears.update(_mlp_linears(f"{names.block}.experts.{e}",
                                    config.expert_intermediate_size, d,
                                    names=(names.gate, names.up, names.down)))
    if config.shared_expert_intermediate_size:
        linears.update(_mlp_linears(f"{names.block}.{names.shared}",
                                    config.shared_expert_intermediate_size, d))
        if names.shared_gate:
            linears[f"{names.block}.{names.shared_gate}"] = (1, d, False)
    return linears


def check_weights(config: ModelConfig, weights: dict[str, Any]) -> None:
    """Refuse a checkpoint whose weights are not exactly those the family reads: one
    missing, of the wrong shape, or left over (an LM head beside tied embeddings is
    dropped where it equals them). Drops the ignorable names from ``weights``."""
    for name in [n for n in weights if n.endswith(IGNORED_SUFFIXES)]:
        del weights[name]
    if config.tie_word_embeddings and "lm_head.weight" in weights:
        head, embed = weights["lm_head.weight"], weights.get("model.embed_tokens.weight")
        if embed is None or head.shape != embed.shape or not bool((head == embed).all()):
            raise UnsupportedModelError("lm_head.weight differs from the embeddings although "
                                        "config.json ties them (tie_word_embeddings)")
        del weights["lm_head.weight"]
    shapes = weight_shapes(config)
    extra = sorted(set(weights) - set(shapes))
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise UnsupportedModelError(f"{config.architecture} does not read weight {extra[0]!r}"
                                    f"{more}: refusing to ignore it")
    missing = sorted(set(shapes) - set(weights))
    if missing:
        raise UnsupportedModelError(f"checkpoint is missing weight {missing[0]!r}")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise UnsupportedModelError(f"weight {name!r} has shape "
                                        f"{tuple(weights[name].shape)}, expected {shape}")
