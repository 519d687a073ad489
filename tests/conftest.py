"""Fixtures shared by several test packages."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import pytest

from common.transfer import TransferAgent

if TYPE_CHECKING:
    from common.engine import Engine


@pytest.fixture(scope="module")
def _engines() -> Iterator[tuple[TransferAgent, TransferAgent]]:
    a, b = TransferAgent(), TransferAgent()
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def agents(_engines: tuple[TransferAgent, TransferAgent]
           ) -> Iterator[tuple[TransferAgent, TransferAgent]]:
    """Two real transfer engines (TCP on loopback): a local and a remote side, shared by
    a module; what a test registered is unregistered after it (a later test's tensor may
    reuse the addresses, and the engine refuses overlapping regions)."""
    yield _engines
    for agent in _engines:
        for address in agent.registered():
            agent.unregister(address)


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
