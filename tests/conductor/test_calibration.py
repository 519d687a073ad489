"""Online refit of the prefill cost model: converges to the true cost, refuses bad fits."""
from __future__ import annotations

import pytest

from common.scheduling import CostModel
from common.scheduling.cost import DecodeCoefficients, PrefillCoefficients
from services.conductor.calibration import PrefillCalibrator

TRUE = PrefillCoefficients(c0=0.01, c_new=0.002, c_cached=0.0001, c_new_cached=0.0,
                           c_new_sq=1e-6)


def wrong_model() -> CostModel:
    return CostModel(PrefillCoefficients(c0=1.0, c_new=0.02), DecodeCoefficients(d0=0.02),
                     46080, 1e9)


def true_seconds(n: int, c: int) -> float:
    return CostModel(TRUE, DecodeCoefficients(), 1, 1.0).prefill_seconds(n, c)


def test_refit_replaces_a_wrong_profile_with_the_observed_cost() -> None:
    cost = wrong_model()
    cal = PrefillCalibrator(cost, refit_every=8)
    sizes = [(n, c) for n in (32, 64, 128, 256, 512, 1024) for c in (0, 256)]
    replaced = [cal.observe(n, c, true_seconds(n, c)) for n, c in sizes]
    assert replaced.count(True) >= 1 and cal.refits >= 1
    for n, c in [(100, 0), (700, 256), (2000, 0)]:
        assert cost.prefill_seconds(n, c) == pytest.approx(true_seconds(n, c), rel=1e-6)


def test_too_few_distinct_sizes_keep_the_profile() -> None:
    cost = wrong_model()
    cal = PrefillCalibrator(cost, refit_every=4)
    for _ in range(20):
        assert not cal.observe(64, 0, 0.5)
    assert cost.prefill.c0 == 1.0 and cal.refits == 0


def test_invalid_samples_are_ignored() -> None:
    cal = PrefillCalibrator(wrong_model(), refit_every=1)
    assert not cal.observe(0, 10, 1.0)
    assert not cal.observe(10, 0, 0.0)
    assert len(cal.samples) == 0


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
