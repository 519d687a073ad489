"""The prefill worker on fakes (tests/worker_fakes.py), for the worker's test modules."""
from __future__ import annotations

from typing import Callable, Iterator

import pytest

from services.prefill.service import PrefillWorker
from tests.worker_fakes import FakeRuntime, Workers

Make = Callable[..., tuple[FakeRuntime, PrefillWorker]]


@pytest.fixture
def make() -> Iterator[Make]:
    """Builds prefill workers (keywords as ``Workers.build``); shuts them down after."""
    workers = Workers()
    yield lambda **kw: workers.build(PrefillWorker, "prefill", **kw)
    workers.close()


def clean(worker: PrefillWorker) -> None:
    """Idle, and the pool says so: every block free, invariants hold."""
    assert worker.idle()
    assert worker.idle_check.run()
