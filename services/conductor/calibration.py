"""Online calibration of the cost model from what the cluster really ran: prefills (their
requests), decode steps (``DecodeCalibrator``) and store reads (``ReadBandwidth``).

The profile (fitted on this machine at a worker's first start, common/engine/calibrate.py,
or a shipped one) times the bare engine; a live request's TTFT adds the reservation, the
messages, the KV handover and the worker's own work between steps, and the machine may be
busier or quieter than when it was measured. So the conductor keeps the profile's shape
and learns two numbers on top of it::

    TTFT(n, c) = overhead + scale * profile(n, c)

``scale``: the compute the prefills reported (their share of each step and what they
waited on transfers) over what the profile predicts for the same prefills, summed over
the last ``window`` of them: long prompts weigh most, as they do in a queue. ``overhead``:
the median of what a request that had its instance to itself (none queued with it: its
time from accept to KV on the decode worker is its own) took beyond its scaled compute.
A queue is priced at the compute alone (``scale * profile``): a request's overhead
overlaps the next one's compute. Both are refitted every ``refit_every`` samples.
Refitting the whole polynomial from the per-request compute shares instead dropped its
fixed and quadratic terms (a step's fixed cost split by tokens gives a short prompt
almost none of it) and predicted a live replay 45 % short.
Prompts of at most ``short_tokens`` to compute (``prefill_preempt_tokens``) take a scale of
their own, from their own reports: each computes in a step of its own, preempting a
longer prompt's, and bears that step's fixed cost alone (in live replays at 2 req/s
1.3-1.6x the profile, where the long prompts' scale was 1.0-1.1: priced at that, three
quarters of the requests were predicted 31-34 % short).
Pure Python: no zmq, no torch.
"""
from __future__ import annotations

import math
from collections import deque
from statistics import median
from typing import TYPE_CHECKING, Optional

from common.scheduling import CostModel

if TYPE_CHECKING:
    from common.protocol import StepTotals  # a type only: common.protocol imports zmq

SCALES = (0.25, 4.0)  # a ratio outside these is a broken sample set, not the machine


class PrefillCalibrator:
    def __init__(self, cost: CostModel, window: int = 64, refit_every: int = 4,
                 min_samples: int = 4, min_alone: int = 4, short_tokens: int = 0) -> None:
        self.cost = cost
        cost.prefill_short_tokens = short_tokens
        self.computed: deque[tuple[float, float]] = deque(maxlen=window)  # (profile, s)
        self.short: deque[tuple[float, float]] = deque(maxlen=window)  # of short prompts
        # (tokens to compute, profile, s)
        self.alone: deque[tuple[int, float, float]] = deque(maxlen=window // 2)
        self.refit_every = refit_every
        self.min_samples, self.min_alone = min_samples, min_alone
        self.refits = 0
        self._since = 0

    def observe_compute(self, new_tokens: int, cached_tokens: int, seconds: float) -> bool:
        """A prefill's reported compute and transfer waits; True if the model changed."""
        if seconds <= 0 or new_tokens <= 0:
            return False
        sample = (self.cost.profile_prefill_seconds(new_tokens, cached_tokens), seconds)
        self.computed.append(sample)
        if new_tokens <= self.cost.prefill_short_tokens:
            self.short.append(sample)
        return self._refit()

    def observe_alone(self, new_tokens: int, cached_tokens: int, ttft_s: float) -> bool:
        """The TTFT of a request alone on its instance; True if the model changed."""
        if ttft_s <= 0 or new_tokens <= 0:
            return False
        self.alone.append((new_tokens, self.cost.profile_prefill_seconds(new_tokens,
                                                                         cached_tokens), ttft_s))
        return self._refit()

    def _refit(self) -> bool:
        self._since += 1
        if self._since < self.refit_every:
            return False
        self._since = 0
        cost = self.cost
        was = (cost.prefill_scale, cost.prefill_short_scale, cost.prefill_overhead_s)
        cost.prefill_scale = self._scale(self.computed, cost.prefill_scale)
        cost.prefill_short_scale = self._scale(self.short, cost.prefill_short_scale)
        if len(self.alone) >= self.min_alone:
            cost.prefill_overhead_s = max(0.0, median(s - cost.scale_for(n) * p
                                                      for n, p, s in self.alone))
        if (cost.prefill_scale, cost.prefill_short_scale, cost.prefill_overhead_s) == was:
            return False
        self.refits += 1
        return True

    def _scale(self, samples: deque[tuple[float, float]],
               scale: Optional[float]) -> Optional[float]:
        """What ``samples`` took over what the profile predicts for them (``scale``, the
        one in use, with too few of them or an implausible ratio)."""
        if len(samples) < self.min_samples:
            return scale
        ratio = sum(s for _, s in samples) / max(sum(p for p, _ in samples), 1e-9)
        return ratio if SCALES[0] <= ratio <= SCALES[1] else scale

    @property
    def samples(self) -> int:
        return len(self.computed) + len(self.alone)


class DecodeCalibrator:
    """Online calibration of the decode profile from the steps decode workers report.

    A token's interval on a live worker is its step and what the worker does around it
    (sampling, streaming the token, its inbox between steps), on a machine maybe busier
    than when the profile was measured; the profile keeps its shape::

        TBT(B, K) = scale * profile(B, K)

    ``scale``: the seconds the steps took over what the profile predicts for the same
    steps, summed over the last ``window`` heartbeats' worth of steps (each beat carries
    a worker's cumulative totals, ``StepTotals``; the difference since its previous beat
    is one sample, dropped if its own ratio is implausible), refitted every
    ``refit_every`` samples."""

    def __init__(self, cost: CostModel, window: int = 32, refit_every: int = 4,
                 min_samples: int = 4) -> None:
        self.cost = cost
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)  # (profile, s)
        self.refit_every, self.min_samples = refit_every, min_samples
        self.refits = 0
        self._since = 0
        # instance -> (epoch, totals): one entry per worker name, replaced on restart
        self._last: dict[str, tuple[int, StepTotals]] = {}

    def observe(self, instance_id: str, epoch: int, totals: StepTotals) -> bool:
        """A decode worker's beat; True if the model changed."""
        last = self._last.get(instance_id)
        self._last[instance_id] = (epoch, totals)
        if last is None or last[0] != epoch or totals.steps <= last[1].steps:
            return False  # its first beat, a new incarnation, or no step since
        was = last[1]
        seconds = totals.seconds - was.seconds
        profile = self.cost.profile_decode_seconds(
            totals.steps - was.steps, totals.sequences - was.sequences,
            totals.context_tokens - was.context_tokens)
        if profile <= 0 or not SCALES[0] <= seconds / profile <= SCALES[1]:
            return False  # a broken sample (a stalled worker), not the machine
        self.samples.append((profile, seconds))
        self._since += 1
        if self._since < self.refit_every or len(self.samples) < self.min_samples:
            return False
        self._since = 0
        ratio = sum(s for _, s in self.samples) / sum(p for p, _ in self.samples)
        if ratio == self.cost.decode_scale:
            return False
        self.cost.decode_scale = ratio
        self.refits += 1
        return True

    def describe(self) -> dict:
        """The scale in use and how far it predicts the samples' steps: the absolute
        relative error, (predicted − measured) / measured, of each beat's steps."""
        scale = self.cost.decode_scale
        errors = sorted(abs(scale * p - s) / s for p, s in self.samples)
        return {"decode_scale": scale, "decode_refits": self.refits,
                "decode_samples": len(errors),
                "decode_p50_abs_rel_error": errors[len(errors) // 2] if errors else None,
                "decode_p90_abs_rel_error": (errors[math.ceil(0.9 * len(errors)) - 1]
                                             if errors else None)}


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
