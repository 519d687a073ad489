"""Online calibration of the prefill cost model, TTFT = overhead + scale * profile: the
scale from the compute prefills report, the overhead from requests alone on their
instance; the profile's shape is kept, implausible ratios refused."""
from __future__ import annotations

import pytest

from common.scheduling import CostModel
from common.scheduling.cost import DecodeCoefficients, PrefillCoefficients
from services.conductor.calibration import DecodeCalibrator, PrefillCalibrator

TRUE = PrefillCoefficients(c0=0.01, c_new=0.002, c_cached=0.0001, c_new_cached=0.0,
                           c_new_sq=1e-6)


def model() -> CostModel:
    return CostModel(TRUE, DecodeCoefficients(d0=0.02), 46080, 1e9)


SIZES = [(n, c) for n in (4, 20, 64, 300, 900) for c in (0, 500)]


def test_scale_from_reported_compute_and_overhead_from_requests_alone() -> None:
    cost = model()
    cal = PrefillCalibrator(cost, refit_every=5)
    for n, c in SIZES:  # the machine computes 1.7x the profile's time
        cal.observe_compute(n, c, 1.7 * model().prefill_seconds(n, c))
    assert cost.prefill_scale == pytest.approx(1.7) and cost.prefill_overhead_s == 0.0
    for n, c in SIZES[:5]:  # alone, a request takes 80 ms more than its compute
        cal.observe_alone(n, c, 0.08 + 1.7 * model().prefill_seconds(n, c))
    assert cost.prefill_overhead_s == pytest.approx(0.08)
    assert cost.prefill == TRUE and cal.refits >= 2  # the shape is the profile's
    for n, c in [(100, 0), (2000, 256), (7, 1000)]:
        live = 0.08 + 1.7 * model().prefill_seconds(n, c)
        assert cost.prefill_seconds(n, c) == pytest.approx(live)
        # a queue waits for the compute only: the overhead overlaps the next one's compute
        assert cost.prefill_compute_seconds(n, c) == pytest.approx(live - 0.08)


def test_long_prompts_weigh_most_in_the_scale() -> None:
    cost = model()
    cal = PrefillCalibrator(cost, refit_every=8)
    for _ in range(7):  # short prompts: each 3x the profile (a fixed cost per step)
        cal.observe_compute(4, 0, 3 * model().prefill_seconds(4, 0))
    cal.observe_compute(2000, 0, model().prefill_seconds(2000, 0))
    assert 1.0 < cost.prefill_scale < 1.1


def test_short_prompts_take_a_scale_of_their_own() -> None:
    """Prompts of at most ``short_tokens`` compute in steps of their own (preempting): their
    reports give their scale; the long ones' stays theirs; a request alone is priced with
    the scale of its length."""
    cost = model()
    cal = PrefillCalibrator(cost, refit_every=1, min_samples=4, min_alone=2, short_tokens=128)
    for _ in range(3):  # too few short ones yet: they are priced as the long ones
        cal.observe_compute(20, 500, 1.5 * model().prefill_seconds(20, 500))
    for n in (300, 900, 2000, 4000):
        cal.observe_compute(n, 0, 1.1 * model().prefill_seconds(n, 0))
    assert cost.prefill_short_scale is None
    assert cost.prefill_compute_seconds(20, 500) == pytest.approx(
        cost.prefill_scale * model().prefill_seconds(20, 500))
    cal.observe_compute(128, 0, 1.5 * model().prefill_seconds(128, 0))
    assert cost.prefill_short_scale == pytest.approx(1.5)
    assert 1.1 < cost.prefill_scale < 1.2  # all seven, the long ones weighing most
    assert cost.prefill_compute_seconds(128, 0) == pytest.approx(
        1.5 * model().prefill_seconds(128, 0))
    assert cost.prefill_compute_seconds(129, 0) == pytest.approx(
        cost.prefill_scale * model().prefill_seconds(129, 0))
    cal.observe_alone(20, 0, 0.05 + 1.5 * model().prefill_seconds(20, 0))
    cal.observe_alone(900, 0, 0.05 + cost.prefill_scale * model().prefill_seconds(900, 0))
    assert cost.prefill_overhead_s == pytest.approx(0.05)
    assert cost.prefill_seconds(20, 0) == pytest.approx(0.05 + 1.5 * model().prefill_seconds(20, 0))


def test_no_short_scale_without_short_tokens() -> None:
    cost = model()
    cal = PrefillCalibrator(cost, refit_every=1)
    for _ in range(8):
        cal.observe_compute(4, 0, 3 * model().prefill_seconds(4, 0))
    assert cost.prefill_short_scale is None and cost.prefill_scale == pytest.approx(3.0)


def test_too_few_samples_keep_the_correction() -> None:
    cost = model()
    cal = PrefillCalibrator(cost, refit_every=1, min_samples=8, min_alone=4)
    for _ in range(7):
        cal.observe_compute(64, 0, 0.5)
    for _ in range(3):
        cal.observe_alone(64, 0, 0.9)
    assert (cost.prefill_overhead_s, cost.prefill_scale, cal.refits) == (0.0, 1.0, 0)


def test_an_implausible_ratio_is_refused() -> None:
    cost = model()
    cal = PrefillCalibrator(cost, refit_every=len(SIZES))
    for n, c in SIZES:  # 10x the profile: a broken sample set, not this machine
        cal.observe_compute(n, c, 10 * model().prefill_seconds(n, c))
    assert cal.refits == 0 and cost.prefill_scale == 1.0


def test_invalid_samples_are_ignored() -> None:
    cal = PrefillCalibrator(model(), refit_every=1)
    assert not cal.observe_compute(0, 10, 1.0)
    assert not cal.observe_alone(10, 0, 0.0)
    assert cal.samples == 0


def _placer(profile: str = "auto") -> "Placer":
    from common.config import ClusterConfig
    from services.conductor.placement import Placer
    return Placer(ClusterConfig(cost_profile=profile))


def test_auto_prices_with_what_the_workers_fitted_on_their_machines() -> None:
    from common.protocol import MachineCost
    placer = _placer()
    shipped = placer.cost.prefill
    fitted = MachineCost("prefill@here", PrefillCoefficients(c0=0.05, c_new=0.001))
    assert placer.adopt(fitted)
    assert placer.cost.prefill == fitted.prefill and placer.cost.prefill != shipped
    assert placer.policy.cost is placer.cost  # the scheduler prices with it
    decode = MachineCost("decode@here", decode=DecodeCoefficients(d0=0.03, d_ctx=1e-5))
    assert placer.adopt(decode)
    assert placer.cost.decode == decode.decode and placer.cost.prefill == fitted.prefill
    # a restart reports the same key: what the online refit learned since is kept
    placer.cost.prefill = TRUE
    assert not placer.adopt(fitted) and placer.cost.prefill == TRUE
    assert placer.describe()["machine_keys"] == ["prefill@here", "decode@here"]
    # a pipeline group's shape starts from the cost in use
    assert placer.cost_of(2).prefill == TRUE


def test_a_pinned_profile_ignores_the_workers_fits() -> None:
    from common.protocol import MachineCost
    placer = _placer("cpu-smollm2-135m")
    before = placer.cost.prefill
    assert not placer.adopt(MachineCost("k", PrefillCoefficients(c0=9.0)))
    assert placer.cost.prefill == before and placer.describe()["machine_keys"] == []


# ---------------------------------------------------------------- decode

def totals(steps: int, batch: int, context: int, seconds_each: float) -> "StepTotals":
    """``steps`` steps of ``batch`` sequences and ``context`` tokens in all, each
    ``seconds_each``."""
    from common.protocol import StepTotals
    return StepTotals(steps, steps * batch, steps * context, steps * seconds_each)


def test_decode_scale_from_the_steps_the_workers_report() -> None:
    """Each beat's totals less the previous beat's are one sample: steps of batch 8 and
    4,000 tokens of context taking 1.5x the profile's time (0.02 + 0.001 * 8 + 1e-5 *
    4000 = 68 ms) make the scale 1.5; TBT predictions follow, in turns too."""
    cost = CostModel(TRUE, DecodeCoefficients(d0=0.02, d_batch=0.001, d_ctx=1e-5), 46080, 1e9)
    cal = DecodeCalibrator(cost, refit_every=2, min_samples=2)
    assert not cal.observe("decode-0", 7, totals(0, 8, 4000, 0.102))  # its first beat
    assert not cal.observe("decode-0", 7, totals(10, 8, 4000, 0.102))
    assert cal.observe("decode-0", 7, totals(25, 8, 4000, 0.102))
    assert cost.decode_scale == pytest.approx(1.5) and cal.refits == 1
    assert cost.decode_tbt_seconds(8, 4000) == pytest.approx(0.102)
    assert cost.decode_tbt_seconds(16, 8000, step_batch=8) == pytest.approx(
        1.5 * (2 * 0.02 + 0.016 + 0.08))
    described = cal.describe()
    assert described["decode_samples"] == 2 and described["decode_p90_abs_rel_error"] == \
        pytest.approx(0.0, abs=1e-9)


def test_a_restart_a_quiet_beat_or_a_broken_ratio_teaches_nothing() -> None:
    cost = CostModel(TRUE, DecodeCoefficients(d0=0.02), 46080, 1e9)
    cal = DecodeCalibrator(cost, refit_every=1, min_samples=1)
    cal.observe("decode-0", 1, totals(50, 1, 100, 0.02))
    assert not cal.observe("decode-0", 2, totals(5, 1, 100, 0.04))  # a new incarnation
    assert not cal.observe("decode-0", 2, totals(5, 1, 100, 0.04))  # no step since
    assert not cal.observe("decode-0", 2, totals(10, 1, 100, 0.2))  # 10x: dropped
    assert cost.decode_scale == 1.0 and cal.refits == 0 and not cal.samples
    assert cal.observe("decode-1", 3, totals(1, 1, 100, 0.03)) is False  # first of another
    assert cal.observe("decode-1", 3, totals(3, 1, 100, 0.03))
    assert cost.decode_scale == pytest.approx(1.5)
