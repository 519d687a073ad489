"""Errors the engine raises on bad input (a caller maps them to HTTP 400)."""
from __future__ import annotations


class EngineInputError(ValueError):
    """A request the engine cannot serve: empty or too long prompt, bad token ids, bad
    sampling parameters, unknown model, malformed block table."""


class UnknownModelError(EngineInputError):
    """EngineConfig.model names no known model, dummy config or checkpoint path."""
