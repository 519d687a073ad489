"""Cost model: formulas, fit, JSON round trip, named profiles."""
from __future__ import annotations

import pytest

from common.scheduling import (
    CostModel,
    DecodeCoefficients,
    PrefillCoefficients,
    fit_prefill_cost,
)


def test_fit_recovers_exact_polynomial() -> None:
    true = PrefillCoefficients(c0=0.05, c_new=2e-4, c_cached=1e-6, c_new_cached=3e-9, c_new_sq=2e-9)
    model = CostModel(true, DecodeCoefficients(), 1, 1.0)
    samples = [(n, c, model.prefill_seconds(n, c))
               for n in (16, 128, 512, 2048, 4096) for c in (0, 256, 1024, 8192)]
    got = fit_prefill_cost(samples)
    for name in ("c0", "c_new", "c_cached", "c_new_cached", "c_new_sq"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6, abs=1e-12)


def test_fit_without_cached_samples_leaves_cached_terms_zero() -> None:
    samples = [(n, 0, 0.01 + 1e-4 * n) for n in (10, 100, 1000)]
    got = fit_prefill_cost(samples)
    assert got.c_cached == 0.0 and got.c_new_cached == 0.0
    assert got.c0 == pytest.approx(0.01) and got.c_new == pytest.approx(1e-4)


def test_fit_needs_samples() -> None:
    with pytest.raises(ValueError):
        fit_prefill_cost([])


def test_formulas() -> None:
    m = CostModel(PrefillCoefficients(c0=1, c_new=2, c_cached=3, c_new_cached=4, c_new_sq=5),
                  DecodeCoefficients(d0=0.5, d_batch=0.25, d_ctx=0.125), 10, 100.0)
    assert m.prefill_seconds(2, 3) == 1 + 4 + 9 + 24 + 20
    assert m.decode_tbt_seconds(4, 8) == 0.5 + 1.0 + 1.0
    assert m.transfer_seconds(250) == 2.5
    assert m.kv_transfer_seconds(25) == 2.5
    assert m.transfer_seconds(0) == 0.0


def test_json_round_trip(tmp_path) -> None:
    m = CostModel.profile("llama3-70b-8xa800")
    path = tmp_path / "cost.json"
    m.to_json(path)
    back = CostModel.from_json(path)
    assert back.to_dict() == m.to_dict()
    assert CostModel.profile(str(path)).to_dict() == m.to_dict()


def test_llama3_70b_profile_anchors() -> None:
    m = CostModel.profile("llama3-70b-8xa800")
    assert m.kv_bytes_per_token == 327_680
    full = m.prefill_seconds(128_000, 0)
    cached = m.prefill_seconds(6_400, 121_600)  # 95 % of a 128k prompt cached
    assert 1 - cached / full == pytest.approx(0.92, abs=0.01)  # paper: -92 %
    assert m.transfer_seconds(512 * m.kv_bytes_per_token) == pytest.approx(1.93e-3, rel=0.01)


def test_unknown_profile() -> None:
    with pytest.raises(KeyError):
        CostModel.profile("gpt-5-on-a-toaster")


def test_decode_slowdown_scales_decode_steps_only() -> None:
    base = CostModel.profile("llama3-70b-8xa800")
    slow = base.with_decode_slowdown(4.0)
    assert slow.decode_tbt_seconds(8, 100_000) == pytest.approx(4.0 * base.decode_tbt_seconds(8, 100_000))
    assert slow.prefill_seconds(1000, 500) == base.prefill_seconds(1000, 500)
    assert slow.kv_transfer_seconds(512) == base.kv_transfer_seconds(512)
    assert slow.name == "llama3-70b-8xa800/decode-x4"
    with pytest.raises(ValueError):
        base.with_decode_slowdown(0.0)
