"""Fixtures shared by several test packages."""
from __future__ import annotations

from typing import Iterator

import pytest

from common.transfer import TransferAgent


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[TransferAgent, TransferAgent]]:
    """Two real transfer engines (TCP on loopback): a local and a remote side."""
    a, b = TransferAgent(), TransferAgent()
    yield a, b
    a.close()
    b.close()
