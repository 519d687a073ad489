"""LLaMA-family decoder (RMSNorm, RoPE, GQA, SwiGLU) over a paged KV cache.

Weights arrive as a dict in HF names; Q/K/V and gate/up are fused into one matmul each.
Attention is delegated to a backend that writes/reads the paged KV memory.

A pipeline stage holds only a contiguous range of layers (``layers``): the first stage
embeds tokens, a later one starts from the hidden states its predecessor computed, and
only the last one has the final norm and the LM head. Layer indices given to the KV
memory and to the hooks are local to the stage (0 is its first layer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from common.model import triton_ops
from common.model.attention import AttentionBackend, AttnMetadata
from common.model.config import ModelConfig
from common.model.rope import apply_rope, cos_sin, inv_frequencies

LayerHook = Callable[[int], None]


class Linear:
    """y = x @ weight.T. On CPU float32 the weight is pre-packed once into oneDNN's blocked
    layout (the op inductor uses for frozen linears): for the small-M GEMMs of decode this
    is 1.4-3x faster than F.linear (MKL), which repacks the weight on every call; results
    differ only by float32 summation order. Elsewhere, or if packing fails its self-check,
    plain F.linear on the original tensor.
    """

    BATCH_HINT = 32  # oneDNN picks its blocking for this M; any M works

    def __init__(self, weight: torch.Tensor, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.weight: Optional[torch.Tensor] = weight
        self.packed: Optional[torch.Tensor] = None
        if pack and _can_pack(weight):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.BATCH_HINT)
                probe = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0))
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
                if torch.allclose(got, F.linear(probe, weight), rtol=1e-4, atol=1e-4):
                    self.packed, self.weight = packed, None
            except (RuntimeError, AttributeError):  # op missing in this torch build
                pass

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None,
                                                      "none", [], "")
        return F.linear(x, self.weight)


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    wqkv: Linear
    wo: Linear
    post_norm: torch.Tensor
    w_gate_up: Linear
    w_down: Linear


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

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class TritonOps:
    """The same steps as fused Triton kernels (common/model/triton_ops.py), one launch
    each: the GPU path, where a decode step is bound by its launches."""

    @staticmethod
    def rope(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return lambda q, k: triton_ops.rope_qk_(q, k, positions, inv_freq)

    rms_norm = staticmethod(triton_ops.rms_norm)
    add_rms_norm = staticmethod(triton_ops.add_rms_norm)
    silu_mul = staticmethod(triton_ops.silu_mul)


POOLED_PARAMS = 1 << 28  # a dummy model larger than this takes its linears from one pool
POOL_SIZE, ROW_STEP = 1 << 26, 257


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights in HF names (std 0.02 linears, unit norms).

    A model of more than ``POOLED_PARAMS`` parameters (the LLaMA-sized dummies) draws one
    pool of ``POOL_SIZE`` values, and each linear is a read-only window of it at a seeded
    offset, row i starting ``ROW_STEP * i`` values after row 0 (rows overlap, and stay
    distinct): it starts in a second with 256 MB, where drawing every value would take
    ~50 s and 32 GB of float32 for 8B parameters. Smaller models draw every value.
    """
    d, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, d)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        shapes[p + "self_attn.q_proj.weight"] = (config.num_heads * hd, d)
        shapes[p + "self_attn.k_proj.weight"] = (config.num_kv_heads * hd, d)
        shapes[p + "self_attn.v_proj.weight"] = (config.num_kv_heads * hd, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, config.num_heads * hd)
        shapes[p + "mlp.gate_proj.weight"] = (i, d)
        shapes[p + "mlp.up_proj.weight"] = (i, d)
        shapes[p + "mlp.down_proj.weight"] = (d, i)
    gen = torch.Generator().manual_seed(seed)
    if sum(r * c for r, c in shapes.values()) > POOLED_PARAMS:
        pool = torch.randn(POOL_SIZE, generator=gen) * 0.02

        def rnd(r: int, c: int) -> torch.Tensor:
            room = POOL_SIZE - ROW_STEP * (r - 1) - c
            offset = int(torch.randint(room, (), generator=gen))
            return pool.as_strided((r, c), (ROW_STEP, 1), offset)
    else:
        def rnd(r: int, c: int) -> torch.Tensor:
            return torch.randn(r, c, generator=gen) * 0.02

    w = {name: rnd(*shape) for name, shape in shapes.items()}
    w["model.norm.weight"] = torch.ones(d)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = torch.ones(d)
        w[p + "post_attention_layernorm.weight"] = torch.ones(d)
    return w


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 pack_weights: bool = True, layers: Optional[range] = None,
                 fused: Optional[bool] = None):
        """``fused``: the layer's elementwise steps as Triton kernels (``TritonOps``);
        None: on a CUDA device where triton is installed."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.layer_range = range(config.num_layers) if layers is None else layers
        if not (0 <= self.layer_range.start < self.layer_range.stop <= config.num_layers
                and self.layer_range.step == 1):
            raise ValueError(f"layers {self.layer_range} is not a contiguous, non-empty range "
                             f"of the model's {config.num_layers} layers")

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint is missing weight {name!r}")
            return weights[name].to(device=self.device, dtype=dtype)

        self.embed: Optional[torch.Tensor] = None
        self.lm_head: Optional[Linear] = None
        if self.first_stage or (self.last_stage and config.tie_word_embeddings):
            self.embed = get("model.embed_tokens.weight")
        if self.last_stage:
            self.norm = get("model.norm.weight")
            self.lm_head = Linear(self.embed if config.tie_word_embeddings
                                  else get("lm_head.weight"), pack_weights)
        self.layers = [self._layer(get, l, pack_weights) for l in self.layer_range]
        factors = weights.get("model.rope_freqs")
        self.inv_freq = inv_frequencies(config, factors).to(self.device)
        if fused is None:
            fused = self.device.type == "cuda" and triton_ops.available()
        self.ops = TritonOps if fused else TorchOps

    @staticmethod
    def _layer(get: Callable[[str], torch.Tensor], layer: int, pack: bool) -> LayerWeights:
        p = f"model.layers.{layer}."
        return LayerWeights(
            input_norm=get(p + "input_layernorm.weight"),
            wqkv=Linear(torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]), pack),
            wo=Linear(get(p + "self_attn.o_proj.weight"), pack),
            post_norm=get(p + "post_attention_layernorm.weight"),
            w_gate_up=Linear(torch.cat([get(p + "mlp.gate_proj.weight"),
                                        get(p + "mlp.up_proj.weight")]), pack),
            w_down=Linear(get(p + "mlp.down_proj.weight"), pack))

    @property
    def first_stage(self) -> bool:
        return self.layer_range.start == 0

    @property
    def last_stage(self) -> bool:
        return self.layer_range.stop == self.config.num_layers

    def forward(self, token_ids: torch.Tensor, meta: AttnMetadata, attention: AttentionBackend,
                layer_hook: Optional[LayerHook] = None, hidden: Optional[torch.Tensor] = None,
                before_layer: Optional[LayerHook] = None) -> torch.Tensor:
        """Hidden states [T, hidden] after this stage's last layer (before the final norm).

        The first stage embeds ``token_ids``; a later one continues from ``hidden``, its
        predecessor's output, on any device (it is moved to ``token_ids``'s).
        ``before_layer(i)`` runs before layer i reads the KV memory (a layer-wise load
        waits there), ``layer_hook(i)`` after it wrote it."""
        cfg = self.config
        if self.first_stage:
            h = self.embed.index_select(0, token_ids)
        elif hidden is None:
            raise ValueError(f"a stage starting at layer {self.layer_range.start} needs the "
                             "hidden states of the stage before it")
        else:  # hidden states may arrive in host memory (a slot of services/prefill/hidden.py)
            h = hidden.to(token_ids.device, self.dtype)
        ops, eps = self.ops, cfg.rms_norm_eps
        rope = ops.rope(self.inv_freq, meta.positions, self.dtype)
        nq, nkv, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        t = h.shape[0]
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        for index, lw in enumerate(self.layers):
            if before_layer is not None:
                before_layer(index)
            q, k, v = lw.wqkv(x).split([nq, nkv, nkv], dim=-1)
            q, k = rope(q.view(t, cfg.num_heads, hd), k.view(t, cfg.num_kv_heads, hd))
            o = attention(index, q, k, v.reshape(t, cfg.num_kv_heads, hd), meta)
            h, x = ops.add_rms_norm(h, lw.wo(o), lw.post_norm, eps)
            down = lw.w_down(ops.silu_mul(lw.w_gate_up(x)))
            if index + 1 < len(self.layers):  # the residual add and the next layer's norm
                h, x = ops.add_rms_norm(h, down, self.layers[index + 1].input_norm, eps)
            else:
                h = h + down
            if layer_hook is not None:
                layer_hook(index)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] of hidden states [N, hidden] (the last stage only)."""
        if self.lm_head is None:
            raise ValueError("only the last pipeline stage has the LM head")
        return self.lm_head(self.ops.rms_norm(hidden, self.norm,
                                              self.config.rms_norm_eps)).float()
