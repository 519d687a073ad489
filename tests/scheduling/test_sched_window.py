"""``PlacedWindow``: the seconds placed lately by prompts shorter than a given one, kept
summed as prompts come and age out, equal to a pass over the window."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.scheduling.window import BIN_TOKENS, PlacedWindow


def naive(placed: list[tuple[float, int, float]], now: float, tokens: int,
          window_s: float) -> float:
    return sum(s for at, t, s in placed if at > now - window_s and t < tokens)


def test_exact_cases() -> None:
    w = PlacedWindow(window_s=20.0)
    w.add(0.0, 100, 1.0)
    w.add(1.0, 101, 2.0)  # the same bin as 100: compared by its exact count
    w.add(2.0, 5000, 4.0)  # past the first 64 bins: the tree grows
    assert [w.seconds_below(t) for t in (100, 101, 102, 5000, 5001, 10 ** 6)] == \
        [0.0, 1.0, 3.0, 3.0, 7.0, 7.0]
    w.expire(20.0)  # the first is 20 s old: gone
    assert (len(w), w.seconds_below(10 ** 6)) == (2, 6.0)
    assert w.entries() == ((101, 2.0), (5000, 4.0))
    w.expire(100.0)
    assert (len(w), w.seconds_below(10 ** 6)) == (0, 0.0)


def test_of_and_the_bin_edges() -> None:
    w = PlacedWindow.of([(BIN_TOKENS - 1, 1.0), (BIN_TOKENS, 2.0), (2 * BIN_TOKENS, 4.0)])
    assert w.seconds_below(BIN_TOKENS) == 1.0
    assert w.seconds_below(BIN_TOKENS + 1) == 3.0
    assert w.seconds_below(2 * BIN_TOKENS) == 3.0
    assert w.seconds_below(0) == 0.0


ops = st.lists(st.tuples(
    st.floats(0.0, 5.0),  # time since the last op
    st.integers(0, 3),  # 0: ask, 1-3: place
    st.integers(1, 40_000),  # tokens
    st.floats(0.0, 30.0),  # seconds
), max_size=120)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_equals_a_pass_over_the_window(steps: list[tuple[float, int, int, float]]) -> None:
    w, placed, now = PlacedWindow(window_s=20.0), [], 0.0
    for dt, op, tokens, seconds in steps:
        now += dt
        w.expire(now)
        if op:
            w.add(now, tokens, seconds)
            placed.append((now, tokens, seconds))
        else:
            assert w.seconds_below(tokens) == pytest.approx(
                naive(placed, now, tokens, 20.0), abs=1e-9)
            assert len(w) == sum(1 for at, _, _ in placed if at > now - 20.0)
