"""Effective request capacity: the fastest trace replay at which enough requests meet the SLOs.

The paper's effective request capacity is the highest request rate at which the cluster
still meets its SLOs. We replay the trace at speed multiplier ``s`` (arrival times / s,
so the request rate is ``s x`` the trace's mean rate) with no admission control (every
request is served, so overload shows up as SLO misses, not as rejections) and call the
capacity the largest ``s`` whose SLO attainment (share of all requests meeting both the
TTFT and the TBT SLO) is at least ``threshold`` (0.9 by default). The search brackets
``s`` by doubling/halving from ``start`` and then bisects geometrically until the bracket
is within ``rel_tol``; every replay yields the attainment at all TBT SLOs at once, so the
brackets of the different SLOs share their replays. Attainment is assumed to fall with
speed (the search reports the edge of the first failure it brackets).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

# speed -> {tbt_slo: attainment}
Evaluate = Callable[[float], dict[float, float]]


@dataclass
class CapacityResult:
    capacity: dict[float, float]                    # tbt_slo -> max passing speed (0: none)
    bracket: dict[float, tuple[float, float]]       # tbt_slo -> (pass, fail) speeds
    runs: dict[float, dict[float, float]] = field(default_factory=dict)  # speed -> attainment


def find_capacity(evaluate: Evaluate, tbt_slos: Sequence[float], threshold: float = 0.9,
                  start: float = 1.0, rel_tol: float = 0.05, min_speed: float = 1 / 64,
                  max_speed: float = 64.0) -> CapacityResult:
    runs: dict[float, dict[float, float]] = {}

    def att(speed: float, slo: float) -> float:
        if speed not in runs:
            runs[speed] = evaluate(speed)
        return runs[speed][slo]

    bracket: dict[float, tuple[float, float]] = {}
    for slo in tbt_slos:
        # The widest known bracket from earlier SLOs' runs.
        passing = [s for s in runs if runs[s][slo] >= threshold]
        failing = [s for s in runs if runs[s][slo] < threshold]
        lo = max(passing) if passing else 0.0
        hi = min([s for s in failing if s > lo], default=math.inf)
        if lo == 0.0 and hi == math.inf:
            s = start
            if att(s, slo) >= threshold:
                lo = s
            else:
                hi = s
        while hi == math.inf and lo < max_speed:         # grow until a failure
            s = lo * 2
            if att(s, slo) >= threshold:
                lo = s
            else:
                hi = s
        while lo == 0.0 and hi > min_speed:              # shrink until a pass
            s = hi / 2
            if att(s, slo) >= threshold:
                lo = s
            else:
                hi = s
        while lo > 0.0 and hi < math.inf and hi / lo > 1 + rel_tol:
            s = math.sqrt(lo * hi)
            if att(s, slo) >= threshold:
                lo = s
            else:
                hi = s
        bracket[slo] = (lo, hi)
    return CapacityResult({slo: bracket[slo][0] for slo in tbt_slos}, bracket, runs)
