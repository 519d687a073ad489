"""benchmarks/timeline.py: processes' lines merged into timelines, hops in stage order,
the compute and the rest, grouped and rendered (exact cases, no cluster)."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import timeline

ROUTER = """\
100.000 router_in cmpl-a
100.002 router_sent cmpl-a 16384
100.500 first_written cmpl-a
100.501 first_written cmpl-a
200.000 router_in cmpl-b
200.001 router_sent cmpl-b 1024
200.400 first_written cmpl-b
"""
PREFILL = """\
100.010 prefill_in cmpl-a
100.012 admitted cmpl-a 14736
100.013 step cmpl-a 256
100.300 step cmpl-a 112
100.400 computed cmpl-a
100.401 kv_ready cmpl-a
200.010 prefill_in cmpl-b
200.011 admitted cmpl-b 0
200.012 step cmpl-b 256
200.312 computed cmpl-b
100.405 no_such_stage cmpl-a
garbage
"""


@pytest.fixture()
def directory(tmp_path: Path) -> Path:
    (tmp_path / "router-0-1.log").write_text(ROUTER)
    (tmp_path / "prefill-0-2.log").write_text(PREFILL)
    return tmp_path


def test_merged_timeline_keeps_first_passes(directory: Path) -> None:
    a = timeline.load(directory)["cmpl-a"]
    assert a.at["step"] == 100.013 and a.detail["step"] == "256"  # the first step
    assert a.at["first_written"] == 100.500
    assert "no_such_stage" not in a.at
    assert a.number("admitted") == 14736 and a.number("computed") is None
    hops = dict(a.hops())
    assert list(hops) == ["router_in → router_sent", "router_sent → prefill_in",
                          "prefill_in → admitted", "admitted → step", "step → computed",
                          "computed → kv_ready", "kv_ready → first_written"]
    assert hops["kv_ready → first_written"] == pytest.approx(0.099)
    assert a.compute_s == pytest.approx(0.387)
    assert a.total_s == pytest.approx(0.5)
    assert a.outside_s == pytest.approx(0.113)


def test_grouped_by_length_and_cache(directory: Path) -> None:
    groups = timeline.grouped(timeline.load(directory).values(), timeline.by_tokens)
    assert set(groups) == {"16384 warm", "1024 cold"}
    cold = groups["1024 cold"]
    assert cold["requests"] == 1
    assert cold["compute_s"] == pytest.approx(0.3)
    assert cold["outside_s"] == pytest.approx(0.1)
    assert list(cold["hops_s"])[0] == "router_in → router_sent"
    text = timeline.render(groups)
    assert "16384 warm" in text and "outside compute" in text
    assert "113.00" in text and "100.00" in text  # the two outsides, ms


def test_a_request_without_its_end_has_no_outside() -> None:
    got: dict[str, timeline.Timeline] = {}
    timeline.parse(["1.0 router_in cmpl-c ", "1.1 step cmpl-c 16", "1.2 computed cmpl-c "],
                   got)
    c = got["cmpl-c"]
    assert c.compute_s == pytest.approx(0.1)
    assert c.total_s is None and c.outside_s is None
    assert timeline.by_tokens(c) is None  # no router_sent: no group
    assert timeline.summary([c])["outside_s"] is None
