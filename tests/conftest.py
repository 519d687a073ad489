"""Fixtures shared by several test packages."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

from common.transfer import TransferAgent

if TYPE_CHECKING:
    from common.engine import Engine


TESTS = Path(__file__).parent
# Packages whose modules share one set-up (tests/multihost: the network namespaces and
# the package's clusters on fixed addresses).
ONE_GROUP_PACKAGES = {"multihost"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`make test` runs the suite on two xdist workers (``--dist loadgroup``), and a group
    runs whole on one worker: each module is a group (its module-scoped clusters and its
    fixed ports are its own), the request tests that share the e2e package's clusters
    (``shared``) are one, and so is each package of ``ONE_GROUP_PACKAGES``."""
    for item in items:
        path = Path(str(item.fspath)).relative_to(TESTS)
        if path.parts[0] in ONE_GROUP_PACKAGES:
            group = path.parts[0]
        elif "shared" in getattr(item, "fixturenames", ()):
            group = "e2e-shared-clusters"
        else:
            group = str(path)
        item.add_marker(pytest.mark.xdist_group(group))


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
