"""A model's weights as its decoder (common/model/decoder.py) reads them: each tensor on
the device and in the dtype the model runs in, a layer's linears joined into one matmul
each (q/k/v, gate/up: common/model/linear.py ``Linear``), a quantized linear kept so where
a kernel multiplies it (``Checkpoint.matrix``), and the layers' larger parts built: a
mixture of experts (common/model/moe.py) and DeepSeek's latent attention
(common/model/latent.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from common.model import cpu_linear
from common.model.arch import ExpertNames
from common.model.config import ModelConfig
from common.model.latent import LatentAttention, absorbed, deinterleaved
from common.model.linear import Linear
from common.model.moe import GatedMLP, Mixture
from common.model.quant import QuantizedWeight, is_quantized

MLP_NAMES = ("gate_proj", "up_proj", "down_proj")  # a gated MLP's linears (HF names)


@dataclass
class Checkpoint:
    """A model's weights (HF names), read to the device and dtype it runs in."""

    weights: dict[str, torch.Tensor | QuantizedWeight]
    device: torch.device
    dtype: torch.dtype
    norm_offset: float  # Gemma stores a norm's scale less 1
    linear_dtype: Optional[torch.dtype] = None  # the linears multiply in it (Linear)
    quantized: bool = True  # quantized linears stay so where they can (``matrix``)
    expanded: int = 0  # parameters of quantized matrices ``matrix`` expanded to float
    kept: int = 0  # and of those it kept quantized

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise KeyError(f"checkpoint is missing weight {name!r}")
        weight = self.weights[name]
        if is_quantized(weight):
            weight = weight.dequantize()
        return weight.to(device=self.device, dtype=self.dtype)

    def matrix(self, name: str, expert: bool = False) -> torch.Tensor | QuantizedWeight:
        """A linear's weight: as quantized as the file holds it where the linears
        multiply in float32 or int8 on a CPU that runs the quantized kernels (``Linear``),
        else ``get``'s, counted in ``expanded``: bfloat16 linears keep their own kernel,
        which multiplies 1.3-1.5x faster than the float32-input one at 8 rows and more
        (BENCHMARKS.md, "Quantized linears"). An ``expert``'s stays quantized with
        bfloat16 linears too: it sees few of a step's rows, and a mixture's experts are
        most of its weights (a 30B-A3B's would take ~58 GB expanded to bfloat16)."""
        weight = self.weights.get(name)
        if not is_quantized(weight):
            return self.get(name)
        if (self.quantized and self.device.type == "cpu" and self.dtype is torch.float32
                and (expert or self.linear_dtype in (None, torch.float32, torch.int8))
                and cpu_linear.quant_kernel() is not None):
            self.kept += weight.shape[0] * weight.shape[1]
            return weight
        self.expanded += weight.shape[0] * weight.shape[1]
        return self.get(name)

    def norm(self, name: str) -> torch.Tensor:
        """A norm's scale (the offset added in float32)."""
        return (self.get(name).float() + self.norm_offset).to(self.dtype)

    def linear(self, names: list[str], bias: bool, pack: bool, expert: bool = False) -> Linear:
        """One matmul for the linears ``names`` of a layer (q/k/v, gate/up)."""
        parts = [self.matrix(n + ".weight", expert) for n in names]
        weight = (QuantizedWeight.cat(parts) if all(map(is_quantized, parts))
                  else torch.cat([p.dequantize() if is_quantized(p) else p for p in parts]))
        return Linear(weight, pack, torch.cat([self.get(n + ".bias") for n in names])
                      if bias else None, self.linear_dtype)

    def rows(self, name: str, order: Optional[torch.Tensor], pack: bool) -> Linear:
        """A linear of weight ``name`` (no bias), its rows in ``order`` (None: as stored)."""
        weight = self.matrix(name + ".weight")
        if order is not None:
            weight = (weight.rows(order) if is_quantized(weight)
                      else weight.index_select(0, order.to(weight.device)))
        return Linear(weight, pack, None, self.linear_dtype)

    def latent(self, cfg: ModelConfig, prefix: str, pack: bool) -> LatentAttention:
        """Layer ``prefix``'s latent attention, interleaved rotary rows made halves,
        kv_b_proj absorbed a head at a time (expanded if quantized: it is small)."""
        p = prefix + "self_attn."
        width = cfg.qk_nope_head_dim + cfg.rope_dim  # of a head's q
        q_rows, kv_rows = cfg.num_heads * width, cfg.kv_lora_rank + cfg.rope_dim
        q_order = kv_order = None
        if cfg.rope_interleaved:
            q_order = deinterleaved(cfg, q_rows, width, cfg.qk_nope_head_dim)
            kv_order = deinterleaved(cfg, kv_rows, kv_rows, cfg.kv_lora_rank)
        lora = bool(cfg.q_lora_rank)
        absorb_q, absorb_v = absorbed(cfg, self.get(p + "kv_b_proj.weight"), pack,
                                      self.linear_dtype)
        return LatentAttention(
            q=self.rows(p + ("q_b_proj" if lora else "q_proj"), q_order, pack),
            q_a=self.rows(p + "q_a_proj", None, pack) if lora else None,
            q_a_norm=self.norm(p + "q_a_layernorm.weight") if lora else None,
            kv_a=self.rows(p + "kv_a_proj_with_mqa", kv_order, pack),
            kv_a_norm=self.norm(p + "kv_a_layernorm.weight"),
            absorb_q=absorb_q, absorb_v=absorb_v)

    def gated_mlp(self, prefix: str, names: tuple[str, str, str], bias: bool,
                  pack: bool, expert: bool = False) -> GatedMLP:
        gate, up, down = (f"{prefix}.{n}" for n in names)
        return GatedMLP(self.linear([gate, up], bias, pack, expert),
                        self.linear([down], bias, pack, expert))

    def mixture(self, config: ModelConfig, prefix: str, names: ExpertNames,
                pack: bool) -> Mixture:
        """Layer ``prefix``'s mixture of experts: its router multiplies in the model's
        dtype, unquantized (as llama.cpp keeps it); the experts as any linear."""
        block = f"{prefix}{names.block}"
        experts = [self.gated_mlp(f"{block}.experts.{e}", (names.gate, names.up, names.down),
                                  False, pack, expert=True) for e in range(config.num_experts)]
        shared = shared_gate = None
        if config.shared_expert_intermediate_size:
            shared = self.gated_mlp(f"{block}.{names.shared}", MLP_NAMES, False, pack)
            if names.shared_gate:
                shared_gate = Linear(self.get(f"{block}.{names.shared_gate}.weight"), pack)
        return Mixture(Linear(self.get(f"{block}.gate.weight"), pack), experts,
                       config.experts_per_token, config.normalize_experts, shared, shared_gate,
                       sigmoid=config.router_scoring == "sigmoid",
                       bias=(self.get(f"{block}.gate.e_score_correction_bias").float()
                             if config.router_bias else None),
                       groups=config.expert_groups, groups_per_token=config.expert_groups_per_token,
                       group_score=config.expert_group_score, scale=config.routed_scaling)
