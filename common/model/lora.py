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
stacked into one [r_q + r_k + r_v, in] matrix and their B matrices kept by part (the scale
folded in, ``LoraSlot``), so a fused linear's update is one call however many of its
parts an adapter targets: on the CPU csrc/lora.c, which computes each row alone, in
float32 (``_dtype``: weights held in bfloat16 where the linears multiply in it). A row's
update, like its base output, does not depend on the batch, so a greedy answer does not
change with the load.

Refused by name (``AdapterError``): targets other than the attention's q/k/v/o and a dense
MLP's gate/up/down (embeddings, the LM head, experts, DeepSeek's latent projections),
``modules_to_save``, DoRA, trained biases, ``fan_in_fan_out``, QA-LoRA, aLoRA, added
tokens, and pickled weights.
"""
from __future__ import annotations

import ctypes
import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from common.kv.block_keys import ADAPTER_FILES
from common.model import native
from common.model.config import ModelConfig

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
    """One adapter's updates, by the decoder's stage-local layer and fused linear."""
    name: str
    layers: dict[int, dict[str, "LoraSlot"]] = field(default_factory=dict)
    rank: int = 0  # the largest r of its modules


def read_adapter(path: str | Path, config: Optional[ModelConfig] = None
                 ) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT adapter directory's config and tensors (a GGUF adapter's as the directory it
    was converted from would hold them: common/model/gguf_loader.py ``read_lora``, for a
    model of ``config``), checked for what is refused."""
    root = Path(path)
    if root.suffix == ".gguf" and root.is_file():
        if config is None:
            raise AdapterError(f"{root}: a GGUF adapter is read for its model")
        from common.model.gguf_loader import read_lora  # (it imports this module)

        return read_lora(root, config)
    if not (root / CONFIG_FILE).is_file():
        raise AdapterError(f"{root}: no {CONFIG_FILE} (a LoRA adapter is a PEFT directory, "
                           "as save_pretrained writes it)")
    if not (root / WEIGHTS_FILE).is_file():
        pickled = " (adapter_model.bin is not read: save with safe_serialization)" \
            if (root / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{root}: no {WEIGHTS_FILE}{pickled}")
    added = root / "added_tokens.json"
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
        tensors = load_file(str(root / WEIGHTS_FILE))
        added_tokens = json.loads(added.read_text() or "{}") if added.is_file() else {}
    except (ValueError, OSError, SafetensorError) as exc:
        raise AdapterError(f"{root}: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{root}: {CONFIG_FILE} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{root}: a {kind} adapter; only LoRA is served")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise AdapterError(f"{root}: {what} is not supported")
    if added_tokens:
        raise AdapterError(f"{root}: added tokens (added_tokens.json) need the adapter's "
                           "own tokenizer and embeddings; not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{root}: trained biases (bias = {config['bias']!r}) are not "
                           "supported")
    return config, tensors


def _alpha(config: dict, module: str) -> float:
    """``lora_alpha``, or ``alpha_pattern``'s value for ``module`` (a full name), matched
    as PEFT matches it: the pattern is the name or a dotted suffix of it."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            return float(alpha)
    return float(config.get("lora_alpha", 8))


def _scale(config: dict, module: str, rank: int) -> float:
    """A module's scale: alpha / r (rsLoRA: alpha / sqrt(r)); a GGUF adapter without an
    alpha, 1 (as llama.cpp takes it)."""
    if config.get("lora_alpha", 8) is None:
        return 1.0
    alpha = _alpha(config, module)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def load_adapter(name: str, path: str | Path, model: "DecoderModel") -> LoraAdapter:
    """Adapter ``name`` at ``path`` for ``model``'s layers (a pipeline stage keeps its own),
    its weights in ``_dtype(model)``."""
    config, tensors = read_adapter(path, model.config)
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
        scale = _scale(config, full, rank)
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
           parts: list[tuple[int, torch.Tensor, torch.Tensor]], path: str | Path) -> "LoraSlot":
    """One fused linear's update: its adapted parts' A stacked, their B by part."""
    width, outs = _widths(model, slot)
    offsets = [sum(outs[:i]) for i in range(len(outs))]
    rank = sum(a.shape[0] for _, a, _ in parts)
    if rank > MAX_RANK:
        raise AdapterError(f"{path}: layer {model.layer_range.start + local} {slot}: rank "
                           f"{rank} over its parts; at most {MAX_RANK} is served")
    bt = torch.zeros(rank, sum(outs))
    cols, ranks = [], [0]
    for part, a, b in parts:
        if a.shape[1] != width or b.shape[0] != outs[part]:
            layer = model.layer_range.start + local
            raise AdapterError(f"{path}: layer {layer} {slot}: lora_A {tuple(a.shape)} and "
                               f"lora_B {tuple(b.shape)} do not fit the model's "
                               f"[{outs[part]}, {width}] linear")
        first, r = ranks[-1], a.shape[0]
        bt[first:first + r, offsets[part]:offsets[part] + outs[part]] = b.T
        cols += [offsets[part], offsets[part] + outs[part]]
        ranks.append(first + r)
    dtype = _dtype(model)
    a_all = torch.cat([a for _, a, _ in parts])
    return LoraSlot(a_all.T.to(model.device, dtype).contiguous(),
                    bt.to(model.device, dtype).contiguous(), cols, ranks)


MAX_RANK = 1024  # the most A rows a fused linear's update may stack (csrc/lora.c)


def _dtype(model: "DecoderModel") -> torch.dtype:
    """What an adapter's weights are held in: on the CPU float32, or bfloat16 where the
    model's linears multiply in it and csrc/lora.c runs (half the bytes a decode step
    reads; the kernel makes them float32 exactly as it loads them); on a GPU the model's
    dtype."""
    if model.device.type != "cpu":
        return model.dtype
    bf16 = torch.bfloat16 in (model.dtype, model.linear_dtype)
    return torch.bfloat16 if bf16 and _kernel() is not None else torch.float32


@functools.cache
def _kernel() -> Optional[ctypes._CFuncPtr]:
    """csrc/lora.c's entry point, where it is built (AVX-512); else None."""
    lib = native.library()
    fn = getattr(lib, "lora_f32_par", None) if lib is not None else None
    if fn is not None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, p, p, i64, i64, i64, p, p, i64, p, p, i64, i64]
        fn.restype = None
        if lib.lora_max_rank() != MAX_RANK:
            raise RuntimeError("csrc/lora.c's MAX_RANK differs from common/model/lora.py's")
    return fn


@dataclass
class LoraSlot:
    """One adapter's update of one fused linear: A of its adapted parts stacked and
    transposed [in, rank], their B transposed [rank, out] (scaled, zero outside each
    part's block), both float32 or both bfloat16 (``_dtype``); part p has outputs
    [cols[2p], cols[2p + 1]) and A rows [ranks[p], ranks[p + 1])."""
    at: torch.Tensor
    bt: torch.Tensor
    cols: list[int]
    ranks: list[int]

    def __post_init__(self) -> None:
        self._cols = torch.tensor(self.cols, dtype=torch.long)
        self._ranks = torch.tensor(self.ranks, dtype=torch.long)

    def add(self, x: torch.Tensor, y: torch.Tensor, rows: Optional[torch.Tensor]
            ) -> torch.Tensor:
        """``y`` with the update of ``x``'s ``rows`` (None: all) added to the same rows.
        On the CPU csrc/lora.c adds it in place, each row alone, in float32; elsewhere
        (a GPU, a CPU without AVX-512) torch's matmuls add it."""
        fn = _kernel()
        if fn is None or x.device.type != "cpu":
            xs = x if rows is None else x.index_select(0, rows)
            t = xs.to(self.at.dtype) @ self.at
            d = torch.zeros(xs.shape[0], y.shape[1], dtype=t.dtype, device=t.device)
            for p in range(len(self.ranks) - 1):
                r0, r1, c0, c1 = *self.ranks[p:p + 2], *self.cols[2 * p:2 * p + 2]
                d[:, c0:c1] = t[:, r0:r1] @ self.bt[r0:r1, c0:c1]
            d = d.to(y.dtype)
            return y + d if rows is None else y.index_add(0, rows, d)
        out = y if y.dtype is torch.float32 and y.is_contiguous() else \
            y.float().contiguous()
        x = x.float().contiguous()
        m = x.shape[0] if rows is None else rows.shape[0]
        fn(x.data_ptr(), out.data_ptr(), None if rows is None else rows.data_ptr(), m,
           x.shape[1], out.shape[1], self.at.data_ptr(), self.bt.data_ptr(),
           self.at.dtype is torch.bfloat16, self._cols.data_ptr(), self._ranks.data_ptr(),
           len(self.ranks) - 1, native.threads(m))
        return out if out is y else out.to(y.dtype)


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
        """``y`` (the base linear ``slot`` of stage-local ``layer`` applied to ``x``; changed
        in place where it is float32) with each group's update added to its rows."""
        for adapter, rows in self.groups:
            update = adapter.layers.get(layer, {}).get(slot)
            if update is not None:
                y = update.add(x, y, rows)
        return y
