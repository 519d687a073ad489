"""Where requests' time went between the processes: the files ``CRESCENT_TIMELINE_DIR``
made (common/timeline.py) merged into each request's timeline, then a table per group of
requests: the median of each hop between consecutive stages, the compute (its first step's
start to its last step's end) and everything else ("outside": the router's intake to the
first token's chunk written, less the compute).

    python benchmarks/timeline.py DIR

prints a column for each prompt length, cold and warm, and, last, a JSON line.
benchmarks/prefill.py ``--timeline`` runs its clusters with the timeline on and reports
its requests with this module.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.timeline import STAGES  # noqa: E402

ORDER = {stage: i for i, stage in enumerate(STAGES)}


@dataclass
class Timeline:
    """One request: the first time it passed each stage, and that line's detail."""

    request_id: str
    at: dict[str, float] = field(default_factory=dict)
    detail: dict[str, str] = field(default_factory=dict)

    def hops(self) -> list[tuple[str, float]]:
        """``("a → b", seconds)`` between each two consecutive stages it passed."""
        passed = sorted(self.at, key=ORDER.__getitem__)
        return [(f"{a} → {b}", self.at[b] - self.at[a]) for a, b in zip(passed, passed[1:])]

    @property
    def compute_s(self) -> Optional[float]:
        if "step" in self.at and "computed" in self.at:
            return self.at["computed"] - self.at["step"]
        return None

    @property
    def total_s(self) -> Optional[float]:
        if "router_in" in self.at and "first_written" in self.at:
            return self.at["first_written"] - self.at["router_in"]
        return None

    @property
    def outside_s(self) -> Optional[float]:
        """The time to the first token that was not the prompt's compute."""
        total, compute = self.total_s, self.compute_s
        return None if total is None or compute is None else total - compute

    def number(self, stage: str) -> Optional[int]:
        value = self.detail.get(stage)
        return int(value) if value else None


def parse(lines: Iterable[str], into: dict[str, Timeline]) -> None:
    """Add ``<time> <stage> <request id> [detail]`` lines; unknown stages are skipped."""
    for line in lines:
        parts = line.rstrip("\n").split(" ", 3)
        if len(parts) < 3 or parts[1] not in ORDER:
            continue
        t = into.setdefault(parts[2], Timeline(parts[2]))
        if parts[1] not in t.at:
            t.at[parts[1]] = float(parts[0])
            t.detail[parts[1]] = parts[3] if len(parts) > 3 else ""


def load(directory: Path) -> dict[str, Timeline]:
    """Every request of a run: the processes' files merged."""
    out: dict[str, Timeline] = {}
    for path in sorted(directory.glob("*.log")):
        with path.open() as f:
            parse(f, out)
    return out


def summary(timelines: list[Timeline]) -> dict:
    """Medians over ``timelines`` (one group): each hop, the compute, the outside."""
    hops: dict[str, list[float]] = {}
    for t in timelines:
        for name, seconds in t.hops():
            hops.setdefault(name, []).append(seconds)

    def med(values: list[Optional[float]]) -> Optional[float]:
        have = [v for v in values if v is not None]
        return statistics.median(have) if have else None

    return {"requests": len(timelines),
            "total_s": med([t.total_s for t in timelines]),
            "compute_s": med([t.compute_s for t in timelines]),
            "outside_s": med([t.outside_s for t in timelines]),
            "hops_s": {name: statistics.median(v) for name, v in sorted(
                hops.items(), key=lambda kv: ORDER[kv[0].split(" → ")[0]])}}


def grouped(timelines: Iterable[Timeline],
            key: Callable[[Timeline], Optional[str]]) -> dict[str, dict]:
    """``summary`` of each group ``key`` names (None: left out)."""
    groups: dict[str, list[Timeline]] = {}
    for t in timelines:
        name = key(t)
        if name is not None:
            groups.setdefault(name, []).append(t)
    return {name: summary(ts) for name, ts in groups.items()}


def by_tokens(t: Timeline) -> Optional[str]:
    """``<prompt tokens> cold|warm`` (warm: it had tokens it need not compute)."""
    tokens = t.number("router_sent")
    if tokens is None:
        return None
    return f"{tokens} {'warm' if t.number('admitted') else 'cold'}"


def render(groups: dict[str, dict]) -> str:
    """One column per group, one row per hop (ms), then the compute and the outside."""
    names = list(groups)
    hops: list[str] = []
    for g in groups.values():
        hops += [h for h in g["hops_s"] if h not in hops]
    hops.sort(key=lambda h: ORDER[h.split(" → ")[0]])

    def ms(v: Optional[float]) -> str:
        return "-" if v is None else f"{1e3 * v:.2f}"

    width = max([len(h) for h in hops] + [25])
    cols = [max(8, len(n)) for n in names]

    def row(label: str, cells: list[str]) -> str:
        return f"{label:<{width}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, cols))

    lines = [row("ms (medians)", names),
             row("requests", [str(groups[n]["requests"]) for n in names])]
    lines += [row(h, [ms(groups[n]["hops_s"].get(h)) for n in names]) for h in hops]
    lines += [row(label, [ms(groups[n][key]) for n in names])
              for label, key in (("compute", "compute_s"), ("outside compute", "outside_s"),
                                 ("router in → first written", "total_s"))]
    return "\n".join(lines)


def main() -> None:
    import orjson

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path)
    args = p.parse_args()
    groups = grouped(load(args.directory).values(), by_tokens)
    print(render(groups))
    print(orjson.dumps({"bench": "timeline", "groups": groups}).decode())


if __name__ == "__main__":
    main()
