"""Requests the conductor has admitted, as explicit states with deadlines."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from common.protocol import SubmitRequest


class Phase(enum.Enum):
    RESERVING = "reserving"  # ReserveBlocks sent to the decode worker
    PREFILLING = "prefilling"  # PrefillTask sent to the prefill worker
    DECODING = "decoding"  # KV landed; decode worker streams tokens


@dataclass
class Tracked:
    req: SubmitRequest
    prefill_id: str
    decode_id: str
    phase: Phase
    phase_deadline: float
    predicted_ttft_s: float
    accepted_at: float  # wall clock (time.time), like Placer.place's ``now``
    prefill_tokens: int  # uncached tokens the prefill worker must compute (prediction)
    decode_tokens: int = 0  # prompt + max_tokens: the KV it may hold on the decode worker
    decode_started_at: Optional[float] = None  # wall clock of PrefillDone: decode began


class Tracker:
    def __init__(self) -> None:
        self.requests: dict[str, Tracked] = {}
        self._before_decode: set[str] = set()  # admitted, KV not yet on a decode worker

    def add(self, t: Tracked) -> None:
        self.requests[t.req.request_id] = t
        if t.phase is not Phase.DECODING:
            self._before_decode.add(t.req.request_id)

    def get(self, request_id: str) -> Optional[Tracked]:
        return self.requests.get(request_id)

    def pop(self, request_id: str) -> Optional[Tracked]:
        self._before_decode.discard(request_id)
        return self.requests.pop(request_id, None)

    def set_phase(self, t: Tracked, phase: Phase, deadline: float) -> None:
        t.phase, t.phase_deadline = phase, deadline
        if phase is Phase.DECODING:
            self._before_decode.discard(t.req.request_id)

    def waiting_for_prefill(self) -> int:
        return len(self._before_decode)

    def on_worker(self, instance_id: str) -> list[Tracked]:
        return [t for t in self.requests.values()
                if instance_id in (t.prefill_id, t.decode_id)]

    def overdue(self, now: float) -> list[Tracked]:
        return [t for rid in self._before_decode
                if now > (t := self.requests[rid]).phase_deadline]
