"""Crescent engine: the model runner every prefill/decode worker wraps."""
from __future__ import annotations

from common.engine.config import DecodeInput, EngineConfig
from common.engine.engine import Engine
from common.engine.errors import EngineInputError, UnknownModelError
from common.engine.generate import GenerationResult, generate, generate_batch
from common.engine.sampling import Sampler, SamplingParams, sample
from common.kv.block_pool import BlockPool, OutOfBlocksError
from common.kv.memory import PagedKVMemory
from common.model.config import ModelConfig

__all__ = [
    "BlockPool", "DecodeInput", "Engine", "EngineConfig", "EngineInputError",
    "GenerationResult", "ModelConfig", "OutOfBlocksError", "PagedKVMemory", "Sampler",
    "SamplingParams", "UnknownModelError", "generate", "generate_batch", "sample",
]
