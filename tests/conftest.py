"""Fixtures shared by several test packages."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import pytest

from common.transfer import TransferAgent

if TYPE_CHECKING:
    from common.engine import Engine


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[TransferAgent, TransferAgent]]:
    """Two real transfer engines (TCP on loopback): a local and a remote side."""
    a, b = TransferAgent(), TransferAgent()
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="session")
def smol() -> "Engine":
    """The default model (SmolLM2-135M-Instruct, float32, CPU), shared by the session."""
    from common.engine import Engine, EngineConfig

    return Engine(EngineConfig(num_blocks=256, prefill_chunk=512))


@pytest.fixture
def tiny() -> "Engine":
    """A dummy model with random weights and 4-token blocks: fast, for KV bookkeeping."""
    from common.engine import Engine, EngineConfig

    return Engine(EngineConfig(model="dummy-tiny", num_blocks=64, block_size=4,
                               prefill_chunk=512))
