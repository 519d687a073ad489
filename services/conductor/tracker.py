"""Requests the conductor has admitted, as explicit states with deadlines."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from common.protocol import Fence, SubmitRequest


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
    decode_tokens: int = 0  # the KV it may hold on its decode worker (Placement.kv_tokens)
    decode_started_at: Optional[float] = None  # wall clock of PrefillDone: decode began
    reserved_at: Optional[float] = None  # wall clock of BlocksReserved: the prefill sent
    # nothing else was waiting on its prefill instance from its accept to its KV landing:
    # its TTFT is its own (the online calibration learns from such requests)
    alone: bool = False
    attempt: int = 0  # 1 once re-run after its prefill worker was lost (at most once)
    store_loads: bool = True  # False once re-run after its store load failed
    fence: Optional[Fence] = None  # the live reservation's, from BlocksReserved
    keys: frozenset[str] = field(init=False, repr=False, compare=False)  # req.block_keys

    def __post_init__(self) -> None:
        self.keys = frozenset(self.req.block_keys)


@dataclass
class Loss:
    """What losing a worker means for the requests placed on it (the failure policy).

    The prefill worker lost: a request before its first token is re-run once,
    invisibly (it fails if it was re-run already); one already decoding elsewhere is
    untouched (its KV has landed). The decode worker lost: a request still reserving
    there is re-run the same way; one whose prefill started may have had tokens streamed
    already (the decode worker starts on the prefill's KVReady, before the conductor hears
    PrefillDone), so it fails as resumable, and the router, which knows what the client
    got, goes on with a continuation where it can (services/router/resume.py), else ends
    the stream with an error event."""

    rerun: list[Tracked] = field(default_factory=list)
    fail: list[tuple[Tracked, str]] = field(default_factory=list)  # with what was lost
    detach: list[Tracked] = field(default_factory=list)  # decoding elsewhere: keep going
    resume: list[Tracked] = field(default_factory=list)  # its decode worker lost after prefill


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

    def lost(self, instance_id: str) -> Loss:
        """The failure policy for the requests on a lost worker (see ``Loss``)."""
        loss = Loss()
        for t in self.on_worker(instance_id):
            if t.decode_id == instance_id and t.phase is not Phase.RESERVING:
                loss.resume.append(t)  # its KV may have landed, and tokens gone out
            elif t.decode_id == instance_id and t.attempt > 0:
                loss.fail.append((t, "decode worker lost before decoding, on the re-run"))
            elif t.decode_id == instance_id:
                loss.rerun.append(t)
            elif t.phase is Phase.DECODING:
                loss.detach.append(t)
            elif t.attempt == 0:
                loss.rerun.append(t)
            else:
                loss.fail.append((t, "prefill worker lost on the re-run too"))
        return loss

    def overdue(self, now: float) -> list[Tracked]:
        return [t for rid in self._before_decode
                if now > (t := self.requests[rid]).phase_deadline]
