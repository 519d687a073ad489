"""Predicted vs actual TTFT of the last admitted requests, for benchmarks and debugging.

Admission is only as good as its TTFT prediction, so the conductor keeps, per request,
what it predicted at placement and what happened: accept → the KV of the whole prompt on
the decode worker (PrefillDone), which is the first token minus the hop to the router.
A bounded ring (the last ``capacity`` requests) read as JSON from another thread (the
metrics HTTP server), hence the lock. Relative error = (predicted − actual) / actual:
negative when the conductor was optimistic.
"""
from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class TTFTRecord:
    request_id: str
    accepted_at: float  # wall clock (time.time) of placement
    predicted_ttft_s: float
    actual_prefill_ttft_s: float  # accept → KV on the decode worker
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens the prefill worker was predicted to compute
    # where the actual time went: accept → the decode worker's blocks reserved (the prefill
    # task sent then), and what the prefill worker reported (PrefillDone)
    reserve_s: float = 0.0
    cached_tokens: int = 0  # the prompt's tokens the worker found cached (or loaded)
    compute_s: float = 0.0
    wait_s: float = 0.0
    admit_s: float = 0.0

    @property
    def rel_error(self) -> Optional[float]:
        if self.actual_prefill_ttft_s <= 0:
            return None
        return (self.predicted_ttft_s - self.actual_prefill_ttft_s) / self.actual_prefill_ttft_s


class TTFTLog:
    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._ring: deque[TTFTRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.cost: Callable[[], dict[str, Any]] = dict  # the cost model predicting now

    def record(self, rec: TTFTRecord) -> None:
        with self._lock:
            self._ring.append(rec)

    def records(self) -> list[TTFTRecord]:
        with self._lock:
            return list(self._ring)

    def __len__(self) -> int:
        return len(self._ring)

    def snapshot(self) -> dict[str, Any]:
        """The JSON body of ``/debug/ttft``: a summary, the cost model in use and every
        record, oldest first."""
        recs = self.records()
        errors = [e for e in (r.rel_error for r in recs) if e is not None]
        summary: dict[str, Any] = {"count": len(recs), "median_rel_error": None,
                                   "median_abs_rel_error": None, "p90_abs_rel_error": None,
                                   "within_25pct": None}
        if errors:
            absolute = sorted(abs(e) for e in errors)
            summary.update(
                median_rel_error=statistics.median(errors),
                median_abs_rel_error=statistics.median(absolute),
                p90_abs_rel_error=absolute[math.ceil(0.9 * len(absolute)) - 1],
                within_25pct=sum(e <= 0.25 for e in absolute) / len(absolute))
        rows = [dict(asdict(r), rel_error=r.rel_error) for r in recs]
        return {"summary": summary, "cost": self.cost(), "requests": rows}
