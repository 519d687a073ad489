"""Chained block keys: the one function every process uses to name a KV block.

key_i = xxh3_128(parent_key || model_fingerprint || int32-LE token ids of block i), where
the fingerprint covers the model config and the KV dtype.
Only full blocks get keys. Deterministic across processes and hosts (no Python hash()).
"""
from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import xxhash

KEY_NBYTES = 16


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype="<i4").tobytes()


def compute_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    model_fingerprint: bytes,
    parent: Optional[bytes] = None,
) -> list[bytes]:
    """Keys of the full blocks of `token_ids` (a trailing partial block gets none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[bytes] = []
    prev = parent if parent is not None else b""
    data = _token_bytes(token_ids)  # once: a 16k prompt's blocks are slices of it
    width = 4 * block_size
    for start in range(0, len(data) - width + 1, width):
        prev = xxhash.xxh3_128(prev + model_fingerprint + data[start:start + width]).digest()
        keys.append(prev)
    return keys


# ModelConfig's fields added 2026-11-29 (mixtures of experts, latent attention), with the
# value a model without them has: left out of a fingerprint where they have it, so that
# the other models' blocks keep the keys they had (in a store, on disk)
ADDED_FIELDS = {"num_experts": 0, "experts_per_token": 0, "expert_intermediate_size": 0,
                "shared_expert_intermediate_size": 0, "normalize_experts": True,
                "dense_layers": (), "router_scoring": "softmax", "router_bias": False,
                "expert_groups": 1, "expert_groups_per_token": 1, "expert_group_score": 2,
                "routed_scaling": 1.0,
                "q_lora_rank": 0, "kv_lora_rank": 0, "qk_nope_head_dim": 0, "v_head_dim": 0,
                "rope_dim": 0, "rope_interleaved": False}


def model_fingerprint(config: Any, kv_dtype: str = "float32",
                      quantization: str = "auto") -> bytes:
    """16-byte fingerprint of a model config (a dataclass or a dict), the dtype its KV
    is stored in and the rounding its weights were given at load, stable across hosts:
    blocks of one prompt in different KV dtypes, or from weights quantized at load
    (``quantization`` "q8_0", "q4_0"), are different bytes, so they get different keys
    and never mix in the pool or the store ("auto" and "none" compute the same floats).
    Every process that names blocks (engine, router) must pass the same values."""
    fields = asdict(config) if is_dataclass(config) else dict(config)
    for name, absent in ADDED_FIELDS.items():
        if name in fields and (tuple(fields[name]) if isinstance(fields[name], list)
                               else fields[name]) == absent:
            del fields[name]
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    rounded = f"|weights:{quantization}".encode() if quantization not in ("auto", "none") else b""
    return xxhash.xxh3_128(b"crescent-model-v1" + blob + b"|kv:" + kv_dtype.encode()
                           + rounded).digest()


# A LoRA adapter's directory (PEFT's save_pretrained; common/model/lora.py)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_fingerprint(fingerprint: bytes, path: str | Path) -> bytes:
    """The fingerprint of a LoRA adapter's blocks: the base model's ``fingerprint`` and the
    bytes of the adapter's files. A prompt's blocks on two adapters never share keys (their
    KV differs from the first layer the adapter changes), while one adapter served under
    two names does; an adapter changed on disk under its old name gets new keys."""
    digest = xxhash.xxh3_128(b"crescent-lora-v1" + fingerprint)
    files = [Path(path)] if Path(path).is_file() else [Path(path) / n for n in ADAPTER_FILES]
    for file in files:  # a GGUF adapter's one file, or a PEFT directory's two
        if not file.is_file():
            raise FileNotFoundError(f"LoRA adapter {path}: no {file.name}")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.digest()
