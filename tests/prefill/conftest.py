"""The prefill worker on fakes (tests/worker_fakes.py), for the worker's test modules."""
from __future__ import annotations

from typing import Callable, Iterator

import pytest

from services.prefill.service import PrefillWorker
from tests.worker_fakes import FakeRuntime, clean, workers_of

Make = Callable[..., tuple[FakeRuntime, PrefillWorker]]
__all__ = ["Make", "clean", "make"]


@pytest.fixture
def make() -> Iterator[Make]:
    """Builds prefill workers (keywords as ``Workers.build``); shuts them down after."""
    yield from workers_of(PrefillWorker, "prefill")
