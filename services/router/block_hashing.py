"""Block keys of a prompt as the conductor matches them: hex of the chained 128-bit keys.

The fingerprint is ``model_fingerprint`` of the engine's own ``ModelConfig`` (see
services/router/tokenizer.py), so the keys equal those the workers report in KV events;
a LoRA adapter's prompts get ``adapter_fingerprint``'s, as the workers' engines do.
"""
from __future__ import annotations

from typing import Callable, Optional

from common.kv.block_keys import adapter_fingerprint, compute_block_keys, model_fingerprint
from common.model.config import ModelConfig
from common.service import StartupError

BlockHasher = Callable[[list[int], Optional[str]], list[str]]  # (token ids, adapter)


def make_block_hasher(block_size: int, model_config: ModelConfig,
                      kv_dtype: str = "float32", quantization: str = "auto",
                      adapters: Optional[dict[str, str]] = None) -> BlockHasher:
    """``(token_ids, adapter) → [hex key of each full block]`` (``kv_dtype``: the workers'
    resolved KV dtype, and ``quantization``, part of the fingerprint; ``adapters``: the
    LoRA adapters' directories by name, whose files are part of theirs)."""
    fingerprint = model_fingerprint(model_config, kv_dtype, quantization)
    fingerprints: dict[Optional[str], bytes] = {None: fingerprint}
    for name, path in (adapters or {}).items():
        try:
            fingerprints[name] = adapter_fingerprint(fingerprint, path)
        except OSError as exc:
            raise StartupError(f"lora_modules.{name}: {exc}") from None

    def block_keys(token_ids: list[int], adapter: Optional[str] = None) -> list[str]:
        return [k.hex() for k in compute_block_keys(token_ids, block_size,
                                                    fingerprints[adapter])]

    return block_keys
