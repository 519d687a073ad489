"""What the router remembers for its dashboard: the last requests' timelines and rates over
the last seconds. Bounded: the live requests (each removed when it finishes), the last
``keep`` finished ones, and one bucket a second per rate. Pure: times are passed in.

A timeline is laid end to end from the request's arrival (wall clock, like
``SubmitRequest.arrival_time``):

    queued   arrival → compute start: admission, the decode worker's reservation, the
             prefill worker's queue, steps of other prompts, messages in between
    prefill  the request's share of prefill compute (``PrefillDone.prefill_seconds``)
    transfer the prefill blocked on transfers: store loads, the last KV writes
             (``PrefillDone.wait_s``; the stream itself overlaps compute)
    decode   first token → last token, as the router saw them

``queued`` is what is left of the time to first token once the other two are taken out,
so the three add up to it exactly; a request that never got a token is all ``queued``.

The prefill's figures and the KV rates come from the conductor's ``ClusterStatus``, the
one place that counts KV transfers: its ``prefills`` fill the timelines, and what its
``totals`` grew by since the previous status feeds the rates.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from common.protocol import RequestAccepted
from common.status_protocol import ClusterStatus, ConductorTotals, PrefillSummary

PHASES = ("queued", "prefill", "transfer", "decode")


class RateWindow:
    """A quantity summed per whole second over the last ``window_s`` seconds."""

    def __init__(self, window_s: int = 10) -> None:
        self.window_s = window_s
        self._buckets: deque[list[float]] = deque()  # [second, sum], oldest first

    def add(self, value: float, now: float) -> None:
        second = float(int(now))
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += value
        else:
            self._buckets.append([second, value])
        self._drop_old(now)

    def _drop_old(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] <= int(now) - self.window_s:
            self._buckets.popleft()

    def sum(self, now: float) -> float:
        self._drop_old(now)
        return sum(v for _, v in self._buckets)

    def rate(self, now: float) -> float:
        """Per second, over the window."""
        return self.sum(now) / self.window_s


@dataclass
class Timeline:
    """One request as the router saw it, plus its prefill's figures from the conductor."""

    request_id: str
    endpoint: str
    arrival: float
    status: Optional[int] = None  # the HTTP status, once finished
    accepted: Optional[float] = None
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    ended: Optional[float] = None
    prefill_id: str = ""
    decode_id: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    prefill_s: float = 0.0
    wait_s: float = 0.0
    transfer_s: float = 0.0  # the KV stream in flight (overlaps compute)
    transfer_bytes: int = 0
    model: str = ""  # the served name it ran on: the model's or a LoRA adapter's

    def phases(self) -> dict[str, float]:
        """Seconds of each phase (``PHASES``), laid end to end from the arrival."""
        end = self.ended if self.ended is not None else self.arrival
        if self.first_token is None:
            return {"queued": max(0.0, end - self.arrival), "prefill": 0.0,
                    "transfer": 0.0, "decode": 0.0}
        ttft = max(0.0, self.first_token - self.arrival)
        prefill = min(self.prefill_s, ttft)
        transfer = min(self.wait_s, ttft - prefill)
        last = self.last_token if self.last_token is not None else self.first_token
        return {"queued": ttft - prefill - transfer, "prefill": prefill,
                "transfer": transfer, "decode": max(0.0, last - self.first_token)}

    def as_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "endpoint": self.endpoint, "model": self.model,
                "status": self.status, "arrival": self.arrival, "ended": self.ended,
                "prefill_id": self.prefill_id, "decode_id": self.decode_id,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "output_tokens": self.output_tokens, "transfer_bytes": self.transfer_bytes,
                "transfer_s": self.transfer_s,
                "phases": {k: round(v, 6) for k, v in self.phases().items()}}


class RequestLog:
    """Timelines of live and recently finished requests; admission and KV rates."""

    def __init__(self, keep: int = 40, window_s: int = 10) -> None:
        self.live: dict[str, Timeline] = {}
        self.keep = keep
        self.done: deque[Timeline] = deque(maxlen=keep)
        self.window_s = window_s
        self.admitted = RateWindow(window_s)
        self.rejected = RateWindow(window_s)  # answered 429
        self.kv_bytes = RateWindow(window_s)
        self.kv_seconds = RateWindow(window_s)
        self._totals: Optional[tuple[int, ConductorTotals]] = None  # (epoch, last heard)

    def arrived(self, request_id: str, endpoint: str, arrival: float, model: str = "") -> None:
        self.live[request_id] = Timeline(request_id, endpoint, arrival, model=model)

    def accepted(self, msg: RequestAccepted, now: float) -> None:
        t = self.live.get(msg.request_id)
        if t is not None and t.accepted is None:
            t.accepted, t.prefill_id, t.decode_id = now, msg.prefill_id, msg.decode_id
            self.admitted.add(1, now)

    def tokens(self, request_id: str, n: int, now: float) -> None:
        t = self.live.get(request_id)
        if t is None:
            return
        if t.first_token is None:
            t.first_token = now
        t.last_token = now
        t.output_tokens += n

    def heard(self, status: ClusterStatus, now: float) -> None:
        """A conductor's status: its prefills onto their timelines, its transfer totals
        into the rates."""
        for p in status.prefills:
            self.prefilled(p)
        if status.totals is not None:
            self.moved(status.conductor_epoch, status.totals, now)

    def prefilled(self, p: PrefillSummary) -> None:
        """A request's prefill figures; they may come after its last token."""
        t = self.live.get(p.request_id) or next(
            (d for d in self.done if d.request_id == p.request_id), None)
        if t is not None:
            t.prefill_s, t.wait_s = p.prefill_s, p.wait_s
            t.transfer_s, t.transfer_bytes = p.transfer_s, p.transfer_bytes

    def moved(self, epoch: int, totals: ConductorTotals, now: float) -> None:
        """What the conductor's transfer totals grew by since its previous status goes
        into the rates. The first totals heard are only a baseline (what came before is
        not of this window); a new conductor incarnation counts from zero."""
        last = self._totals
        if last is not None:
            base = last[1] if last[0] == epoch else ConductorTotals()
            self.kv_bytes.add(totals.transfer_bytes - base.transfer_bytes, now)
            self.kv_seconds.add(totals.transfer_seconds - base.transfer_seconds, now)
        self._totals = (epoch, totals)

    def finished(self, request_id: str, status: int, usage: Optional[tuple[int, int]],
                 now: float) -> None:
        t = self.live.pop(request_id, None)
        if t is None:
            return
        t.status, t.ended = status, now
        if usage is not None:
            t.prompt_tokens, t.cached_tokens = usage
        if status == 429:
            self.rejected.add(1, now)
        self.done.append(t)

    def timelines(self) -> list[dict[str, Any]]:
        """The finished requests, newest first."""
        return [t.as_dict() for t in reversed(self.done)]
