"""Per-request records of a simulation and their summary (TTFT, TBT, SLOs, hits, rejects)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

COMPLETED = "completed"
REJECTED_ARRIVAL = "rejected_at_arrival"
REJECTED_AFTER_PREFILL = "rejected_after_prefill"


def tail_tbt(gaps: Sequence[float]) -> float:
    """Per-request TBT: mean of its longest 10 % inter-token gaps (at least one gap)."""
    if not gaps:
        return 0.0
    k = max(1, math.ceil(0.1 * len(gaps)))
    return float(sum(sorted(gaps, reverse=True)[:k]) / k)


@dataclass
class RequestRecord:
    index: int
    arrival_s: float
    status: str = "pending"
    reason: Optional[str] = None
    ttft_s: Optional[float] = None
    tbt_s: Optional[float] = None
    finish_s: Optional[float] = None


@dataclass
class HitCounter:
    total_blocks: int = 0
    local_blocks: int = 0
    fetched_blocks: int = 0

    def add(self, total: int, local: int, fetched: int) -> None:
        self.total_blocks += total
        self.local_blocks += local
        self.fetched_blocks += fetched

    @property
    def local_rate(self) -> float:
        return self.local_blocks / max(self.total_blocks, 1)

    @property
    def global_rate(self) -> float:
        return (self.local_blocks + self.fetched_blocks) / max(self.total_blocks, 1)


@dataclass
class SimResult:
    name: str
    records: list[RequestRecord]
    hits: HitCounter = field(default_factory=HitCounter)
    sim_seconds: float = 0.0

    def summary(self, ttft_slo_s: float, tbt_slo_s: float) -> dict[str, float]:
        done = [r for r in self.records if r.status == COMPLETED]
        ttft = np.array([r.ttft_s for r in done], dtype=float)
        tbt = np.array([r.tbt_s for r in done], dtype=float)
        ok = sum(1 for r in done if r.ttft_s <= ttft_slo_s and r.tbt_s <= tbt_slo_s)
        n = max(len(self.records), 1)
        return {
            "requests": float(len(self.records)),
            "completed": float(len(done)),
            "rejected": float(len(self.records) - len(done)),
            "rejected_at_arrival": float(sum(r.status == REJECTED_ARRIVAL for r in self.records)),
            "rejected_after_prefill": float(sum(r.status == REJECTED_AFTER_PREFILL for r in self.records)),
            "ttft_mean": _stat(ttft, None), "ttft_p50": _stat(ttft, 50), "ttft_p90": _stat(ttft, 90),
            "ttft_p99": _stat(ttft, 99),
            "tbt_mean": _stat(tbt, None), "tbt_p50": _stat(tbt, 50), "tbt_p99": _stat(tbt, 99),
            "slo_attainment": ok / n,   # = effective request capacity share
            "hit_local": self.hits.local_rate,
            "hit_global": self.hits.global_rate,
        }


def _stat(a: np.ndarray, pct: Optional[float]) -> float:
    if a.size == 0:
        return float("nan")
    return float(a.mean() if pct is None else np.percentile(a, pct))


def plot_results(results: Sequence[SimResult], out_dir: Path, prefix: str = "sim") -> list[Path]:
    """TTFT and TBT CDFs of several runs (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric, label in (("ttft_s", "TTFT (s)"), ("tbt_s", "TBT, mean of longest 10% gaps (s)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for res in results:
            vals = np.sort([getattr(r, metric) for r in res.records if r.status == COMPLETED])
            if vals.size:
                ax.plot(vals, np.arange(1, vals.size + 1) / vals.size, label=res.name)
        ax.set_xlabel(label)
        ax.set_ylabel("CDF of completed requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = out_dir / f"{prefix}_{metric[:-2]}_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
