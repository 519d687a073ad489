"""A continuous decode batch, kept cheap: O(1) work per step plus O(1) per join/finish.

Members join between steps; each step gives every member one token. A member's gaps are
read off the batch's step end times when it finishes, so no per-token Python work.
"""
from __future__ import annotations

from dataclasses import dataclass

from traces.metrics import tail_tbt


@dataclass
class _Member:
    first_step: int
    decode_tokens: int
    start_context: int
    ready_s: float


class DecodeBatch:
    def __init__(self) -> None:
        self.step_ends: list[float] = []
        self.context_tokens = 0
        self._members: dict[int, _Member] = {}
        self._finish_at: dict[int, list[int]] = {}

    @property
    def size(self) -> int:
        return len(self._members)

    def join(self, rid: int, prompt_tokens: int, decode_tokens: int, ready_s: float) -> None:
        """Join before the next step; ``ready_s`` = when its first token (from prefill) was out."""
        if decode_tokens < 1:
            raise ValueError("a batch member needs at least one decode token")
        first = len(self.step_ends)
        self._members[rid] = _Member(first, decode_tokens, prompt_tokens + 1, ready_s)
        self._finish_at.setdefault(first + decode_tokens - 1, []).append(rid)
        self.context_tokens += prompt_tokens + 1

    def end_step(self, t: float) -> list[tuple[int, float]]:
        """Close the running step at time ``t``; returns (rid, per-request TBT) of finishers."""
        idx = len(self.step_ends)
        self.step_ends.append(t)
        self.context_tokens += len(self._members)
        done = []
        for rid in self._finish_at.pop(idx, ()):
            m = self._members.pop(rid)
            self.context_tokens -= m.start_context + m.decode_tokens
            ends = self.step_ends[m.first_step: idx + 1]
            gaps = [ends[0] - m.ready_s] + [b - a for a, b in zip(ends, ends[1:])]
            done.append((rid, tail_tbt(gaps)))
        return done

    def check_integrity(self) -> None:
        assert self.context_tokens >= 0
        assert sum(len(v) for v in self._finish_at.values()) == len(self._members)
