"""``QueuedPrompts``: a shortest-first queue's seconds ahead of a new prompt and the next
longer prompt, with the oldest gone by their arrival, the first partly done and the live
scales applied: exact cases (the conductor's queues against a pass over them:
tests/conductor/test_queue_incremental.py)."""
from __future__ import annotations

import pytest

from common.scheduling.cost import Scales
from common.scheduling.queued import QueuedPrompts

QUEUE = QueuedPrompts([(300, 3.0), (100, 1.0), (300, 2.0), (50, 0.5)])  # oldest first


def test_as_given() -> None:
    assert (QUEUE.ahead_s(100), QUEUE.ahead_s(49), QUEUE.ahead_s(10 ** 6)) == (1.5, 0.0, 6.5)
    assert (QUEUE.next_longer(100), QUEUE.next_longer(300)) == ((300, 2.0), None)
    assert QUEUE.left_s() == 6.5 and len(QUEUE) == 4


def test_the_oldest_go_by_arrival_and_the_first_is_partly_done() -> None:
    q = QUEUE.at(Scales(), aged=1, first=0, first_s=1.0)
    assert q.entries() == ((0, 1.0), (100, 1.0), (300, 2.0), (50, 0.5))
    assert q.ahead_s(60) == 1.5  # the 50, and the aged 300's second left
    assert q.next_longer(60) == (100, 1.0)
    assert q.next_longer(100) == (300, 2.0)  # not the aged one
    assert q.left_s() == 4.5


def test_a_first_with_less_left_goes_before_its_equals() -> None:
    q = QueuedPrompts([(100, 2.0), (100, 1.0)]).at(Scales(), first=0, first_s=0.5)
    assert q.next_longer(50) == (100, 0.5)
    assert q.ahead_s(100) == pytest.approx(1.5)


def test_short_prompts_by_their_own_scale() -> None:
    q = QueuedPrompts([(300, 3.0), (100, 1.0), (50, 0.5)]).at(
        Scales(long=2.0, short=0.5, short_tokens=100))
    assert q.entries() == ((300, 6.0), (100, 0.5), (50, 0.25))
    assert (q.ahead_s(100), q.ahead_s(300), q.left_s()) == (0.75, 6.75, 6.75)
    assert q.next_longer(100) == (300, 6.0)
