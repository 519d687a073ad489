"""A prompt's predicted wait on a shortest-first prefill instance
(``PrefillInstanceState.wait_s``): the queued prompts no longer than it, part of the
longer one computing, and the stretch by the shorter prompts that will arrive meanwhile."""
from __future__ import annotations

import pytest

from common.scheduling import PrefillInstanceState, PrefixIndex
from common.scheduling.queued import QueuedPrompts
from common.scheduling.window import PlacedWindow

QUEUED = ((100, 1.0), (1000, 4.0))  # (tokens to compute, predicted seconds left)
RECENT = ((50, 2.0), (100, 2.0), (1000, 4.0))  # placed in the last 20 s


def state(queued=QUEUED, recent=RECENT, max_wait_s=None) -> PrefillInstanceState:
    queued = None if queued is None else QueuedPrompts(queued)
    return PrefillInstanceState("p", 5.0, PrefixIndex(), queued=queued, step_tokens=256,
                                recent=PlacedWindow.of(recent), max_wait_s=max_wait_s)


@pytest.mark.parametrize("tokens, own, want", [
    # 100 ahead (1 s), 1.5 steps of the 1000 computing (4 x 384 / 1000), then the 50 and
    # the 100 placed lately (4 s of 20: rho 0.2) stretch wait and compute by 1 / 0.8
    (500, 1.0, (1.0 + 1.536 + 1.0) / 0.8 - 1.0),
    (60, 0.5, (1.0 + 0.5) / 0.9 - 0.5),  # the 100 computing; only the 50 is shorter
    (40, 0.5, 1.0),  # nothing placed was shorter: no stretch
    (2000, 0.0, (5.0 + 0.0) / (1 - 8.0 / 20)),  # all of them ahead, and shorter
])
def test_shorter_arrivals_stretch_the_wait(tokens: int, own: float, want: float) -> None:
    assert state().wait_s(tokens, own_s=own) == pytest.approx(want)


def test_the_stretch_stops_where_the_worker_takes_the_prompt_first() -> None:
    assert state(max_wait_s=3.0).wait_s(500, own_s=1.0) == pytest.approx(3.0)
    # a queue already longer than that: the queue, not stretched
    assert state(max_wait_s=2.0).wait_s(500, own_s=1.0) == pytest.approx(2.536)


def test_at_most_two_fold() -> None:
    busy = tuple((10, 5.0) for _ in range(8))  # 40 s of shorter compute in 20 s
    assert state(queued=(), recent=busy).wait_s(500, own_s=1.0) == pytest.approx(1.0)


def test_arrival_order_waits_for_the_queue() -> None:
    """Nobody arriving later goes first, nobody queued goes after."""
    assert state(queued=None).wait_s(500, own_s=1.0) == 5.0
    assert state(queued=None).wait_s(500, 0.5, own_s=1.0) == 5.0


@pytest.mark.parametrize("behind_s, want", [
    (2.0, (1.0 + 1.536 + 1.0) / 0.8 - 1.0),  # its prefix is done before its turn
    (4.5, 4.5),  # it waits for the prompt computing its prefix
    (9.0, 5.0),  # never longer than the whole queue
])
def test_behind_a_queued_prefix_it_waits_for_that_prompt(behind_s: float, want: float) -> None:
    assert state().wait_s(500, behind_s, own_s=1.0) == pytest.approx(want)
