"""The decode-duration history behind prediction-based early rejection."""
from __future__ import annotations

import pytest

from common.scheduling.decode_time import DecodeDurations


def test_prior_is_the_papers_uniform_decode_time() -> None:
    h = DecodeDurations(prior_s=10.0, min_samples=3)
    h.observe(1.0)
    h.observe(2.0)   # two samples: not learned yet
    assert not h.learned and h.mean() == 10.0
    assert h.survival(9.9) == 1.0 and h.survival(10.0) == 0.0
    assert h.still_running(elapsed_s=4.0, horizon_s=5.0) == 1.0
    assert h.still_running(elapsed_s=4.0, horizon_s=6.0) == 0.0


def test_empirical_survival_and_conditioning_on_elapsed_time() -> None:
    h = DecodeDurations(prior_s=10.0, min_samples=4)
    for s in (8.0, 2.0, 6.0, 4.0):
        h.observe(s)
    assert h.learned and h.mean() == pytest.approx(5.0)
    assert [h.survival(t) for t in (0.0, 2.0, 3.0, 8.0)] == [1.0, 0.75, 0.75, 0.0]
    assert h.still_running(elapsed_s=3.0, horizon_s=2.0) == pytest.approx(0.5 / 0.75)
    assert h.still_running(elapsed_s=5.0, horizon_s=0.0) == 1.0
    # Outlived every duration seen: assumed to keep running (conservative admission).
    assert h.still_running(elapsed_s=9.0, horizon_s=1.0) == 1.0


def test_uniform_mode_uses_the_learned_mean_as_a_step() -> None:
    h = DecodeDurations(prior_s=10.0, min_samples=2, uniform=True)
    h.observe(2.0)
    h.observe(6.0)
    assert h.survival(3.9) == 1.0 and h.survival(4.0) == 0.0
    assert h.still_running(1.0, 2.5) == 1.0 and h.still_running(1.0, 3.0) == 0.0


def test_window_forgets_the_oldest_durations() -> None:
    h = DecodeDurations(prior_s=1.0, window=3, min_samples=1)
    for s in (100.0, 1.0, 2.0, 3.0):
        h.observe(s)
    assert h.samples == 3 and h.mean() == pytest.approx(2.0)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        DecodeDurations(prior_s=0.0)
    with pytest.raises(ValueError):
        DecodeDurations(prior_s=1.0, window=0)
