from __future__ import annotations

import pytest

from common.engine import Engine, EngineConfig


@pytest.fixture(scope="session")
def smol() -> Engine:
    """The default model (SmolLM2-135M-Instruct, float32, CPU), shared by the session."""
    return Engine(EngineConfig(num_blocks=256, prefill_chunk=512))


@pytest.fixture
def tiny() -> Engine:
    return Engine(EngineConfig(model="dummy-tiny", num_blocks=64, block_size=4, prefill_chunk=512))
