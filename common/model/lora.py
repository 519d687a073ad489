"""LoRA adapters served beside their base model: one set of weights, any number of
fine-tunes, each request on the adapter its ``model`` names (vLLM's and SGLang's
multi-LoRA; ClusterConfig.lora_modules).

An adapter is a PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``) of
low-rank updates to a layer's linears: ``W x`` becomes ``W x + s B (A x)``, with A [r, in],
B [out, r] and the scale s = ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``). The base weights are never changed: a step's rows of each adapter get its
update added to the base linear's output (``LoraRows``), so requests of the base model and
of several adapters share one batch.

The updates go with the decoder's fused linears (``Linear``): q, k and v's A matrices are
stacked into one [r_q + r_k + r_v, in] matrix and their B matrices placed block-diagonally
(the scale folded in), so a fused linear's update is two matmuls however many of its parts
an adapter targets. On the CPU both run on Crescent's float32 kernel, which computes each
row alone: a row's update, like its base output, does not depend on the batch, so a greedy
answer does not change with the load.

Refused by name (``AdapterError``): targets other than the attention's q/k/v/o and a dense
MLP's gate/up/down (embeddings, the LM head, experts, DeepSeek's latent projections),
``modules_to_save``, DoRA, bias training, ``fan_in_fan_out``, and pickled weights.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from safetensors.torch import load_file

from common.kv.block_keys import ADAPTER_FILES
from common.model.linear import Linear

if TYPE_CHECKING:
    from common.model.decoder import DecoderModel

CONFIG_FILE, WEIGHTS_FILE = ADAPTER_FILES
# PEFT's module name → (the decoder's fused linear, the part of it)
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
           "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
           "down_proj": ("down", 0)}
ATTENTION, MLP = ("qkv", "o"), ("gate_up", "down")
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                     r"\.lora_([AB])\.weight")
# adapter_config.json's switches for what this module does not compute
_REFUSED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D layers)",
            "modules_to_save": "modules_to_save (fully trained layers)",
            "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
            "lora_bias": "lora_bias (a trained bias of lora_B)",
            "layer_replication": "layer_replication (layers repeated)",
            "use_qalora": "QA-LoRA", "alora_invocation_tokens": "activated LoRA (aLoRA)"}


class AdapterError(ValueError):
    """An adapter this model cannot serve, and why."""


@dataclass
class LoraAdapter:
    """One adapter's updates, by the decoder's stage-local layer and fused linear: the
    stacked A and the block-diagonal, scaled B (module docstring)."""
    name: str
    layers: dict[int, dict[str, tuple[Linear, Linear]]] = field(default_factory=dict)
    rank: int = 0  # the largest r of its modules


def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT adapter directory's config and tensors, checked for what is refused."""
    root = Path(path)
    if not (root / CONFIG_FILE).is_file():
        raise AdapterError(f"{root}: no {CONFIG_FILE} (a LoRA adapter is a PEFT directory, "
                           "as save_pretrained writes it)")
    if not (root / WEIGHTS_FILE).is_file():
        pickled = " (adapter_model.bin is not read: save with safe_serialization)" \
            if (root / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{root}: no {WEIGHTS_FILE}{pickled}")
    config = json.loads((root / CONFIG_FILE).read_text())
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{root}: a {kind} adapter; only LoRA is served")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise AdapterError(f"{root}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{root}: trained biases (bias = {config['bias']!r}) are not "
                           "supported")
    return config, load_file(str(root / WEIGHTS_FILE))


def _alpha(config: dict, module: str) -> float:
    """``lora_alpha``, or ``alpha_pattern``'s value for ``module`` (a full name), matched
    as PEFT matches it: the pattern is the name or a dotted suffix of it."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            return float(alpha)
    return float(config.get("lora_alpha", 8))


def load_adapter(name: str, path: str | Path, model: "DecoderModel") -> LoraAdapter:
    """Adapter ``name`` at ``path`` for ``model``'s layers (a pipeline stage keeps its own),
    its weights in float32 on the CPU (the row-alone kernel), else in the model's dtype."""
    config, tensors = read_adapter(path)
    cfg = model.config
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _TENSOR.fullmatch(key)
        if ".experts." in key or ".shared_expert" in key:
            raise AdapterError(f"{path}: tensor {key!r} updates a mixture's experts; "
                               "adapters of experts are not supported")
        if m is None or m.group(3) not in TARGETS:
            raise AdapterError(f"{path}: tensor {key!r} updates no linear Crescent adapts "
                               f"(q/k/v/o_proj, a dense MLP's gate/up/down_proj)")
        layer, module = int(m.group(1)), m.group(3)
        if not 0 <= layer < cfg.num_layers:
            raise AdapterError(f"{path}: tensor {key!r} is for layer {layer}; the model has "
                               f"{cfg.num_layers}")
        pairs.setdefault((layer, module), {})[m.group(4)] = tensor
    adapter = LoraAdapter(name)
    start = model.layer_range.start
    by_layer: dict[int, dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: layer {layer} {module} has lora_{''.join(ab)} only")
        a, b = ab["A"].float(), ab["B"].float()
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise AdapterError(f"{path}: layer {layer} {module}: lora_A {tuple(a.shape)} and "
                               f"lora_B {tuple(b.shape)} are not [r, in] and [out, r]")
        slot, part = TARGETS[module]
        _check_target(model, layer, slot, path)
        full = f"model.layers.{layer}.{'mlp' if slot in MLP else 'self_attn'}.{module}"
        alpha = _alpha(config, full)
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        adapter.rank = max(adapter.rank, rank)
        if layer in model.layer_range:
            by_layer.setdefault(layer - start, {}).setdefault(slot, []).append(
                (part, a, b * scale))
    for local, slots in by_layer.items():
        adapter.layers[local] = {slot: _fused(model, local, slot, parts, path)
                                 for slot, parts in slots.items()}
    return adapter


def _check_target(model: "DecoderModel", layer: int, slot: str, path: str | Path) -> None:
    cfg = model.config
    if slot in MLP and cfg.sparse(layer):
        raise AdapterError(f"{path}: layer {layer}'s MLP is a mixture of experts; adapters "
                           "of experts are not supported")
    if slot in ATTENTION and model.family.latent:
        raise AdapterError(f"{path}: layer {layer}'s attention is DeepSeek's latent "
                           "attention; its adapters are not supported")


def _widths(model: "DecoderModel", slot: str) -> tuple[int, list[int]]:
    """A fused linear's input width and its parts' output widths."""
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (cfg.hidden_size, [q, kv, kv]), "o": (q, [cfg.hidden_size]),
            "gate_up": (cfg.hidden_size, [cfg.intermediate_size] * 2),
            "down": (cfg.intermediate_size, [cfg.hidden_size])}[slot]


def _fused(model: "DecoderModel", local: int, slot: str,
           parts: list[tuple[int, torch.Tensor, torch.Tensor]], path: str | Path,
           ) -> tuple[Linear, Linear]:
    """One fused linear's (A, B): the parts' A stacked, their B block-diagonal."""
    width, outs = _widths(model, slot)
    offsets = [sum(outs[:i]) for i in range(len(outs))]
    total_rank = sum(a.shape[0] for _, a, _ in parts)
    b_full = torch.zeros(sum(outs), total_rank)
    column = 0
    for part, a, b in parts:
        if a.shape[1] != width or b.shape[0] != outs[part]:
            layer = model.layer_range.start + local
            raise AdapterError(f"{path}: layer {layer} {slot}: lora_A {tuple(a.shape)} and "
                               f"lora_B {tuple(b.shape)} do not fit the model's "
                               f"[{outs[part]}, {width}] linear")
        b_full[offsets[part]:offsets[part] + outs[part], column:column + a.shape[0]] = b
        column += a.shape[0]
    a_full = torch.cat([a for _, a, _ in parts])
    dtype = torch.float32 if model.device.type == "cpu" else model.dtype
    return (Linear(a_full.to(model.device, dtype)), Linear(b_full.to(model.device, dtype)))


@dataclass
class LoraRows:
    """A step's rows by adapter: each group's update is added to its rows' outputs."""
    groups: list[tuple[LoraAdapter, Optional[torch.Tensor]]]  # rows; None: every row

    @staticmethod
    def of(adapters: dict[str, LoraAdapter], runs: Sequence[tuple[Optional[str], int]],
           device: torch.device) -> Optional["LoraRows"]:
        """The groups of a step whose rows come in ``runs``: (an adapter's name, None for
        the base model; that many rows), in order. None where no row has an adapter."""
        rows: dict[str, list[int]] = {}
        start = 0
        for name, count in runs:
            if name is not None:
                rows.setdefault(name, []).extend(range(start, start + count))
            start += count
        if not rows:
            return None
        whole = len(rows) == 1 and len(next(iter(rows.values()))) == start
        return LoraRows([(adapters[name], None if whole else
                          torch.tensor(idx, dtype=torch.long, device=device))
                         for name, idx in rows.items()])

    def add(self, layer: int, slot: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base linear ``slot`` of stage-local ``layer`` applied to ``x``) with
        each group's update added to its rows."""
        for adapter, rows in self.groups:
            ab = adapter.layers.get(layer, {}).get(slot)
            if ab is None:
                continue
            a, b = ab
            if rows is None:
                y = y + b(a(x)).to(y.dtype)
            else:
                y = y.index_add(0, rows, b(a(x.index_select(0, rows))).to(y.dtype))
        return y
