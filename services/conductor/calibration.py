"""Online calibration of the prefill cost model from the prefills the cluster really ran.

The shipped profile is measured once, on some machine, under some load; the cluster it
drives may be faster, slower or busier. Every ``PrefillDone`` carries (new tokens, cached
tokens, seconds); after enough varied samples the prefill polynomial is refitted and the
refit replaces the current coefficients only if it predicts the recent samples better and
never predicts a negative time for them. Pure Python + numpy: no zmq, no torch.
"""
from __future__ import annotations

from collections import deque
from statistics import median
from typing import Optional

from common.scheduling import CostModel, fit_prefill_cost
from common.scheduling.cost import PrefillCoefficients

Sample = tuple[int, int, float]


class PrefillCalibrator:
    def __init__(self, cost: CostModel, window: int = 256, refit_every: int = 16,
                 min_distinct_sizes: int = 4) -> None:
        self.cost = cost
        self.samples: deque[Sample] = deque(maxlen=window)
        self.refit_every = refit_every
        self.min_distinct = min_distinct_sizes
        self.refits = 0
        self._since = 0

    def error(self, coeffs: Optional[PrefillCoefficients] = None) -> float:
        """Median relative error of a model (default: the current one) on the window."""
        model = CostModel(coeffs or self.cost.prefill, self.cost.decode, 1, 1.0)
        return median(abs(model.prefill_seconds(n, c) - s) / max(s, 1e-3)
                      for n, c, s in self.samples)

    def observe(self, new_tokens: int, cached_tokens: int, seconds: float) -> bool:
        """Record one prefill; returns True if the cost model was replaced."""
        if seconds <= 0 or new_tokens <= 0:
            return False
        self.samples.append((new_tokens, cached_tokens, seconds))
        self._since += 1
        if self._since < self.refit_every:
            return False
        self._since = 0
        if len({n for n, _, _ in self.samples}) < self.min_distinct:
            return False
        candidate = fit_prefill_cost(list(self.samples))
        probe = CostModel(candidate, self.cost.decode, 1, 1.0)
        if any(probe.prefill_seconds(n, c) <= 0 for n, c, _ in self.samples):
            return False
        if self.error(candidate) >= self.error():
            return False
        self.cost.prefill = candidate
        self.refits += 1
        return True


class ReadBandwidth:
    """The store's read bandwidth as prefills see it, learned from their loads: bytes over
    seconds summed over the last ``window`` loads of at least ``min_bytes`` (smaller
    ones are mostly round trips, not bandwidth), once ``min_samples`` of them came.
    The scheduler prices a prefix fetch with it (``Scheduler.transfer_seconds``)."""

    def __init__(self, window: int = 32, min_bytes: int = 4 << 20, min_samples: int = 3) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.min_bytes = min_bytes
        self.min_samples = min_samples

    def observe(self, nbytes: int, seconds: float) -> Optional[float]:
        """Record one load; returns the estimate (bytes/s), None until there is one."""
        if nbytes >= self.min_bytes and seconds > 0:
            self.samples.append((nbytes, seconds))
        return self.estimate

    @property
    def estimate(self) -> Optional[float]:
        if len(self.samples) < self.min_samples:
            return None
        return sum(b for b, _ in self.samples) / sum(s for _, s in self.samples)
