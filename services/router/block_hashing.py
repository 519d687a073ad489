"""Block keys of a prompt as the conductor matches them: hex of the chained 128-bit keys.

The fingerprint is ``model_fingerprint`` of the engine's own ``ModelConfig`` (see
services/router/tokenizer.py), so the keys equal those the workers report in KV events.
"""
from __future__ import annotations

from typing import Callable

from common.kv.block_keys import compute_block_keys, model_fingerprint
from common.model.config import ModelConfig

BlockHasher = Callable[[list[int]], list[str]]


def make_block_hasher(block_size: int, model_config: ModelConfig,
                      kv_dtype: str = "float32", quantization: str = "auto") -> BlockHasher:
    """``token_ids → [hex key of each full block]`` (``kv_dtype``: the workers' resolved
    KV dtype, and ``quantization``, part of the fingerprint)."""
    fingerprint = model_fingerprint(model_config, kv_dtype, quantization)

    def block_keys(token_ids: list[int]) -> list[str]:
        return [k.hex() for k in compute_block_keys(token_ids, block_size, fingerprint)]

    return block_keys
