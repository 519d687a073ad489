"""Seeded random weights for the dummy models (common/model/config.py ``DUMMY_CONFIGS``):
benchmarks and tests of model shapes without a checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from common.kv.block_keys import ADAPTER_FILES
from common.model.arch import family
from common.model.config import ModelConfig
from common.model.weights import weight_shapes

POOLED_PARAMS = 1 << 28  # a dummy model larger than this takes its linears from one pool
POOL_SIZE, ROW_STEP = 1 << 26, 257


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights in HF names (std 0.02 linears and biases, norms of scale 1).

    A model of more than ``POOLED_PARAMS`` parameters (the LLaMA-sized dummies) draws one
    pool of ``POOL_SIZE`` values, and each linear is a read-only window of it at a seeded
    offset, row i starting ``ROW_STEP * i`` values after row 0 (fewer for a matrix of more
    rows than the pool holds that way; rows overlap, and stay distinct): it starts in a
    second with 256 MB, where drawing every value would take ~50 s and 32 GB of float32
    for 8B parameters. Smaller models draw every value.
    """
    shapes = weight_shapes(config)
    matrices = {name: shape for name, shape in shapes.items() if len(shape) == 2}
    gen = torch.Generator().manual_seed(seed)
    if sum(r * c for r, c in matrices.values()) > POOLED_PARAMS:
        pool = torch.randn(POOL_SIZE, generator=gen) * 0.02

        def rnd(r: int, c: int) -> torch.Tensor:
            step = min(ROW_STEP, (POOL_SIZE - c) // r)  # a vocabulary of 262k rows fits
            offset = int(torch.randint(POOL_SIZE - step * (r - 1) - c, (), generator=gen))
            return pool.as_strided((r, c), (step, 1), offset)
    else:
        def rnd(r: int, c: int) -> torch.Tensor:
            return torch.randn(r, c, generator=gen) * 0.02

    w = {name: rnd(*shape) for name, shape in matrices.items()}
    unit = 1.0 - family(config).norm_offset  # a norm's stored weight for scale 1
    for name, (n,) in ((n, s) for n, s in shapes.items() if len(s) == 1):
        w[name] = (torch.full((n,), unit) if name.endswith("norm.weight")
                   else torch.randn(n, generator=gen) * 0.02)
    return w


def random_adapter(path: Path, config: ModelConfig, rank: int = 8, seed: int = 0) -> Path:
    """A seeded random LoRA adapter of every linear of every layer at ``rank``, in the
    files PEFT writes (common/model/lora.py; tests/model/test_lora.py serves PEFT's own):
    tests and benchmarks of adapters without a fine-tune. Its updates are small beside
    the weights (B's std 0.02, A's 1/sqrt(in)), as a trained adapter's are."""
    from safetensors.torch import save_file

    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {"self_attn": {"q_proj": (hidden, q), "k_proj": (hidden, kv),
                            "v_proj": (hidden, kv), "o_proj": (q, hidden)},
              "mlp": {"gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                      "down_proj": (inter, hidden)}}  # (in, out)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for block, modules in shapes.items():
            for module, (width, out) in modules.items():
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, width, generator=gen) \
                    / width ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / ADAPTER_FILES[1]))
    (path / ADAPTER_FILES[0]).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": sorted(m for modules in shapes.values() for m in modules)}))
    return path
