"""The prefill worker on fakes (tests/worker_fakes.py), for the worker's test modules."""
from __future__ import annotations

from typing import Callable, Iterator

import pytest

from services.prefill.service import PrefillWorker
from tests.worker_fakes import FakeEngine, FakeRuntime, clean, workers_of

Make = Callable[..., tuple[FakeRuntime, PrefillWorker]]
__all__ = ["Make", "chunks", "clean", "make"]


def chunks(engine: FakeEngine) -> list[list[tuple[int, int, int, list[int]]]]:
    """Each prefill step as (first token, start, end, block table) per chunk."""
    return [[(c.token_ids[0], c.start, c.end, c.block_table) for c in cs]
            for cs, _ in engine.steps]


@pytest.fixture
def make() -> Iterator[Make]:
    """Builds prefill workers (keywords as ``Workers.build``); shuts them down after."""
    yield from workers_of(PrefillWorker, "prefill")
