"""The prefill side's prompt record: every move of its state, allowed or refused."""
from __future__ import annotations

import itertools

import pytest

from services.prefill.job import MOVES, JobState, PromptJob, StageJob

C, R, E = JobState.COMPUTING, JobState.RELOADING, JobState.ENDING
ALLOWED = {(C, R), (C, E), (R, C)}


@pytest.mark.parametrize("start, to", list(itertools.product(JobState, JobState)))
def test_every_move(start: JobState, to: JobState) -> None:
    job = PromptJob(prompt_len=10, state=start)
    if (start, to) in ALLOWED:
        job.move(to)
        assert job.state is to
    else:
        with pytest.raises(RuntimeError, match=f"from {start.value} to {to.value}"):
            job.move(to)
        assert job.state is start


def test_the_table_is_the_one_tested() -> None:
    assert {(a, b) for a, tos in MOVES.items() for b in tos} == ALLOWED


def test_live_and_remaining() -> None:
    job = StageJob(prompt_len=10, done=4, zeros=[0] * 10)
    assert job.remaining == 6 and job.live
    job.aborted = True
    assert not job.live
    job.aborted = False
    job.move(E)
    assert not job.live
