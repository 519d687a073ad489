"""Errors the engine raises on bad input (a caller maps them to HTTP 400)."""
from __future__ import annotations


class EngineInputError(ValueError):
    """A request the engine cannot serve: empty or too long prompt, bad token ids, unknown
    model, malformed block table. (Impossible sampling parameters cannot be built at all:
    common/sampling_params.py.)"""


class UnknownModelError(EngineInputError):
    """EngineConfig.model names no known model, dummy config or checkpoint path: the
    loader's ``ModelNotFoundError``, raised again as an input error of the engine."""
