"""The decoder every family shares (common/model/arch.py): RMSNorm, RoPE, grouped-query
attention and a gated MLP over a paged KV cache, with each family's differences read from
its ``Family`` and ``ModelConfig`` (biases, per-head q/k norms, norms around the attention
and MLP outputs, the activation, the embedding scale, soft-capping, sliding windows, a
mixture of experts for the MLP: common/model/moe.py, DeepSeek's latent attention:
common/model/latent.py).

Weights arrive as a dict in HF names and are read by common/model/checkpoint.py
``Checkpoint``: Q/K/V and gate/up fused into one matmul each (common/model/linear.py
``Linear``), a quantized linear (common/model/quant.py: a GGUF's Q2_K ... Q8_0) kept so on
a CPU model whose linears multiply in float32 or int8, else expanded to float.
Attention is delegated to a backend that writes/reads the paged KV memory.

A pipeline stage holds only a contiguous range of layers (``layers``): the first stage
embeds tokens, a later one starts from the hidden states its predecessor computed, and
only the last one has the final norm and the LM head. Layer indices given to the KV
memory and to the hooks are local to the stage (0 is its first layer).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from common.model import triton_ops
from common.model.arch import family
from common.model.attention import AttentionBackend, AttnMetadata, AttnSpec
from common.model.checkpoint import MLP_NAMES, Checkpoint
from common.model.config import ModelConfig
from common.model.cpu_linear import QuantLinear
from common.model.latent import LatentAttention
from common.model.linear import Linear
from common.model.lora import LoraAdapter, LoraRows
from common.model.moe import GatedMLP, Mixture
from common.model.quant import QuantizedWeight, is_quantized
from common.model.rope import apply_rope, attention_factor, cos_sin, inv_frequencies

LayerHook = Callable[[int], None]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    wqkv: Optional[Linear]  # None where ``latent`` makes q, k and v
    wo: Linear
    mlp_norm: torch.Tensor  # before the MLP (LLaMA's post_attention_layernorm)
    mlp: GatedMLP | Mixture
    attn: AttnSpec
    rope: str  # "global", or "local": a sliding layer's own RoPE base (Gemma3)
    q_norm: Optional[torch.Tensor] = None  # before RoPE: per head (Qwen3, Gemma3), or of the
    # whole projection (OLMoE)
    k_norm: Optional[torch.Tensor] = None
    attn_out_norm: Optional[torch.Tensor] = None  # of the attention's output (Gemma)
    mlp_out_norm: Optional[torch.Tensor] = None   # of the MLP's output (Gemma)
    latent: Optional[LatentAttention] = None  # DeepSeek's q, k and v (common/model/latent.py)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


Rope = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # q, k


class TorchOps:
    """A layer's steps between the matmuls, in torch: the CPU path."""

    @staticmethod
    def rope(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        cos, sin = cos_sin(inv_freq, positions, dtype)  # once per forward
        return lambda q, k: (apply_rope(q, cos, sin), apply_rope(k, cos, sin))

    rms_norm = staticmethod(rms_norm)

    @staticmethod
    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + delta
        return h, rms_norm(h, weight, eps)

    head_norm = staticmethod(rms_norm)  # of each head: x [T, heads, head_dim]

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class TritonOps:
    """The same steps as fused Triton kernels (common/model/triton_ops.py), one launch
    each: the GPU path, where a decode step is bound by its launches."""

    @staticmethod
    def rope(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return lambda q, k: triton_ops.rope_qk_(q, k, positions, inv_freq)

    rms_norm = staticmethod(triton_ops.rms_norm)
    add_rms_norm = staticmethod(triton_ops.add_rms_norm)
    silu_mul = staticmethod(triton_ops.silu_mul)
    gelu_tanh_mul = TorchOps.gelu_tanh_mul  # Gemma's: no kernel of its own yet

    @staticmethod
    def head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return triton_ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def lm_head_native() -> bool:
    """Whether a model with bfloat16 ``linear_dtype`` runs its lm_head on Crescent's kernel
    too (``CRESCENT_LM_HEAD_NATIVE=0``: float32 on oneDNN; read at each model load)."""
    return os.environ.get("CRESCENT_LM_HEAD_NATIVE", "1") != "0"


class DecoderModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor | QuantizedWeight],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 pack_weights: bool = True, layers: Optional[range] = None,
                 fused: Optional[bool] = None, linear_dtype: Optional[torch.dtype] = None,
                 quantized: bool = True):
        """``fused``: the layer's elementwise steps as Triton kernels (``TritonOps``);
        None: on a CUDA device where triton is installed. ``linear_dtype``: the dtype the
        layers' linears multiply in (``Linear``; not the lm_head's), None: ``dtype``.
        ``quantized``: quantized weights stay so where they can (``Checkpoint.matrix``);
        False: all expanded to float."""
        self.config = config
        self.family = family(config)
        self.dtype = dtype
        self.linear_dtype = linear_dtype
        self.device = torch.device(device)
        self.layer_range = range(config.num_layers) if layers is None else layers
        if not (0 <= self.layer_range.start < self.layer_range.stop <= config.num_layers
                and self.layer_range.step == 1):
            raise ValueError(f"layers {self.layer_range} is not a contiguous, non-empty range "
                             f"of the model's {config.num_layers} layers")
        read = Checkpoint(weights, self.device, dtype, self.family.norm_offset, linear_dtype,
                           quantized and pack_weights)

        # quantized as the file holds it on a float32 CPU model (rows expanded as looked up);
        # a tied LM head's packed codes where it has them (held once)
        self.embed: Optional[torch.Tensor | QuantizedWeight | QuantLinear] = None
        self.lm_head: Optional[Linear] = None
        if self.first_stage or (self.last_stage and config.tie_word_embeddings):
            self.embed = read.matrix("model.embed_tokens.weight")
        if self.last_stage:
            self.norm = read.norm("model.norm.weight")
            # the logits in ``dtype``: a bfloat16 lm_head's rounded logits changed SmolLM2's
            # greedy answers (Paris became "L'Étoile, la Marseillaise, ..."); bfloat16 weights
            # on Crescent's kernel sum and return float32 (``lm_head_native``)
            self.lm_head = Linear(self.embed if config.tie_word_embeddings
                                  else read.matrix("lm_head.weight"), pack_weights,
                                  dtype=linear_dtype if lm_head_native() else None,
                                  native_only=True)
            if config.tie_word_embeddings and isinstance(self.lm_head.native, QuantLinear):
                self.embed = self.lm_head.native
        # Gemma: embeddings times sqrt(hidden_size), rounded to the model's dtype as in HF
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5, dtype=dtype)
                            if self.family.embed_scale else None)
        factors = weights.get("model.rope_freqs")  # llama.cpp's (llama3 GGUFs)
        rotated = config.rope_dim or config.head_dim
        freqs = {"global": inv_frequencies(rotated, config.rope_theta, config.rope_scaling,
                                           factors)}
        if config.local_rope_theta is not None:
            freqs["local"] = inv_frequencies(rotated, config.local_rope_theta,
                                             config.local_rope_scaling)
        self.inv_freqs = {kind: f.to(self.device) for kind, f in freqs.items()}
        self.layers = [self._layer(read, l, pack_weights) for l in self.layer_range]
        # LoRA adapters by served name (common/model/lora.py load_adapter; the engine adds them)
        self.adapters: dict[str, LoraAdapter] = {}
        # parameters of quantized matrices held as floats, and held quantized
        self.expanded_quantized, self.kept_quantized = read.expanded, read.kept
        if fused is None:
            fused = self.device.type == "cuda" and triton_ops.available()
        self.ops = TritonOps if fused else TorchOps
        self.gated = {"silu": self.ops.silu_mul, "gelu_tanh": self.ops.gelu_tanh_mul}[
            config.activation]

    def _layer(self, read: Checkpoint, layer: int, pack: bool) -> LayerWeights:
        cfg = self.config
        p = f"model.layers.{layer}."
        norms = {role: read.norm(f"{p}{name}.weight") for role, name in self.family.norms.items()}
        qk_norm = bool(self.family.qk_norm)
        local = "local" in self.inv_freqs and layer in cfg.sliding_layers
        # YaRN scales cos and sin, so q . k by the square: folded into the scale here
        scale = cfg.attention_scale * attention_factor(
            cfg.local_rope_scaling if local else cfg.rope_scaling) ** 2
        latent = self.family.latent
        return LayerWeights(
            input_norm=read.norm(p + "input_layernorm.weight"),
            wqkv=None if latent else read.linear([f"{p}self_attn.{n}_proj" for n in "qkv"],
                                                 cfg.qkv_bias, pack),
            latent=read.latent(cfg, p, pack) if latent else None,
            wo=read.linear([p + "self_attn.o_proj"], cfg.o_bias, pack),
            mlp_norm=norms["mlp_norm"],
            mlp=(read.mixture(cfg, p, self.family.experts, pack) if cfg.sparse(layer)
                 else read.gated_mlp(p + "mlp", MLP_NAMES, cfg.mlp_bias, pack)),
            attn=AttnSpec(scale, cfg.attn_softcap, cfg.window(layer)),
            rope="local" if local else "global",
            q_norm=read.norm(p + "self_attn.q_norm.weight") if qk_norm else None,
            k_norm=read.norm(p + "self_attn.k_norm.weight") if qk_norm else None,
            attn_out_norm=norms.get("attn_out_norm"), mlp_out_norm=norms.get("mlp_out_norm"))

    @property
    def first_stage(self) -> bool:
        return self.layer_range.start == 0

    @property
    def last_stage(self) -> bool:
        return self.layer_range.stop == self.config.num_layers

    @property
    def graphable(self) -> bool:
        """Whether a CUDA graph's decode step serves every layer: each attends plainly (no
        soft-cap, no sliding window: what its decode kernel does; no latent attention,
        not yet tried in a graph) and none routes tokens to experts (common/model/moe.py)."""
        return all(lw.attn.softcap is None and lw.attn.window is None and lw.latent is None
                   and isinstance(lw.mlp, GatedMLP) for lw in self.layers)

    def linears(self) -> Iterator[tuple[str, Linear]]:
        """Every linear of this stage, named ("layer 0 wqkv", "layer 1 experts.3.down",
        "lm_head")."""
        for i, lw in enumerate(self.layers):
            attention = ([("wqkv", lw.wqkv)] if lw.latent is None
                         else list(lw.latent.linears()))
            yield from ((f"layer {i} {name}", lin) for name, lin in
                        [*attention, ("wo", lw.wo), *lw.mlp.linears()])
        if self.lm_head is not None:
            yield "lm_head", self.lm_head

    def forward(self, token_ids: torch.Tensor, meta: AttnMetadata, attention: AttentionBackend,
                layer_hook: Optional[LayerHook] = None, hidden: Optional[torch.Tensor] = None,
                before_layer: Optional[LayerHook] = None,
                lora: Optional[LoraRows] = None) -> torch.Tensor:
        """Hidden states [T, hidden] after this stage's last layer (before the final norm).

        The first stage embeds ``token_ids``; a later one continues from ``hidden``, its
        predecessor's output, on any device (it is moved to ``token_ids``'s).
        ``before_layer(i)`` runs before layer i reads the KV memory (a layer-wise load
        waits there), ``layer_hook(i)`` after it wrote it. A layer is ``front`` (to q, k,
        v), attention, ``back`` (the rest): common/engine/prompt_graphs.py replays the
        pieces between two attentions as CUDA graphs. ``lora``: the rows that run on an
        adapter (``self.adapters``), each group's updates added to its rows' linears."""
        if self.first_stage:
            h = self.embed_tokens(token_ids)
        elif hidden is None:
            raise ValueError(f"a stage starting at layer {self.layer_range.start} needs the "
                             "hidden states of the stage before it")
        else:  # hidden states may arrive in host memory (a slot of services/prefill/hidden.py)
            h = hidden.to(token_ids.device, self.dtype)
        ropes = self.ropes(meta.positions)
        x: Optional[torch.Tensor] = self.ops.rms_norm(h, self.layers[0].input_norm,
                                                      self.config.rms_norm_eps)
        for index, lw in enumerate(self.layers):
            if before_layer is not None:
                before_layer(index)
            q, k, v = self.front(index, x, ropes, lora)
            h, x = self.back(index, h, attention(index, q, k, v, meta, lw.attn), lora)
            if layer_hook is not None:
                layer_hook(index)
        return h

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantLinear):
            h = self.embed.rows(token_ids)
        elif is_quantized(self.embed):
            h = self.embed.rows(token_ids).dequantize()
        else:
            h = self.embed.index_select(0, token_ids)
        return h if self.embed_scale is None else h * self.embed_scale

    def ropes(self, positions: torch.Tensor) -> dict[str, Rope]:
        """Each rope kind's rotation of (q, k) at ``positions``."""
        return {kind: self.ops.rope(inv_freq, positions, self.dtype)
                for kind, inv_freq in self.inv_freqs.items()}

    def front(self, index: int, x: torch.Tensor, ropes: dict[str, Rope],
              lora: Optional[LoraRows] = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``index``'s q [T, heads, hd], k and v [T, kv heads, hd] of its normed
        input ``x``, rotated (``ropes``)."""
        cfg, lw, t = self.config, self.layers[index], x.shape[0]
        if lw.latent is not None:
            return lw.latent.qkv(x, cfg, self.ops, ropes[lw.rope])
        assert lw.wqkv is not None
        nq, nkv, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        qkv = lw.wqkv(x)
        if lora is not None:
            qkv = lora.add(index, "qkv", x, qkv)
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        eps = cfg.rms_norm_eps
        if self.family.qk_norm == "projection":  # OLMoE: the whole q and k
            q = self.ops.rms_norm(q.contiguous(), lw.q_norm, eps)
            k = self.ops.rms_norm(k.contiguous(), lw.k_norm, eps)
        q, k = q.reshape(t, cfg.num_heads, hd), k.reshape(t, cfg.num_kv_heads, hd)
        if self.family.qk_norm == "head":
            q, k = self.ops.head_norm(q, lw.q_norm, eps), self.ops.head_norm(k, lw.k_norm, eps)
        q, k = ropes[lw.rope](q, k)
        return q, k, v.reshape(t, cfg.num_kv_heads, hd)

    def back(self, index: int, h: torch.Tensor, o: torch.Tensor,
             lora: Optional[LoraRows] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """After layer ``index``'s attention ``o``: (the residual stream, the next layer's
        normed input; None after this stage's last layer)."""
        ops, eps, lw = self.ops, self.config.rms_norm_eps, self.layers[index]
        if lw.latent is not None:
            o = lw.latent.output(o, self.config)
        o = lw.wo(o) if lora is None else lora.add(index, "o", o, lw.wo(o))
        if lw.attn_out_norm is not None:
            o = ops.rms_norm(o, lw.attn_out_norm, eps)
        h, x = ops.add_rms_norm(h, o, lw.mlp_norm, eps)
        if lora is None or isinstance(lw.mlp, Mixture):  # an adapter adapts no experts
            down = lw.mlp(x, self.gated)
        else:
            down = lw.mlp(x, self.gated, lambda slot, x, y: lora.add(index, slot, x, y))
        if lw.mlp_out_norm is not None:
            down = ops.rms_norm(down, lw.mlp_out_norm, eps)
        if index + 1 < len(self.layers):  # the residual add and the next layer's norm
            return ops.add_rms_norm(h, down, self.layers[index + 1].input_norm, eps)
        return h + down, None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] of hidden states [N, hidden] (the last stage only)."""
        if self.lm_head is None:
            raise ValueError("only the last pipeline stage has the LM head")
        logits = self.lm_head(self.ops.rms_norm(hidden, self.norm,
                                                self.config.rms_norm_eps)).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
