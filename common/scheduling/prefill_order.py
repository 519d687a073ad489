"""The order a prefill worker computes its prompts in (``prefill_order``), stated once for
the worker that follows it (services/prefill/queue.py) and the conductor that predicts it
(services/conductor/placement.py). Times are the caller's own clock (monotonic on the
worker, wall clock at the conductor): only differences are used."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Rank = tuple[int, float, float]


@dataclass(frozen=True)
class PromptOrder:
    """Which prompt a prefill worker computes first: the least ``rank``."""

    shortest: bool
    max_wait_s: float

    @classmethod
    def of(cls, config: Any) -> "PromptOrder":
        """A ClusterConfig's ``prefill_order`` and ``prefill_max_wait_s``."""
        return cls(config.prefill_order == "shortest", config.prefill_max_wait_s)

    def aged(self, arrived: float, now: float) -> bool:
        """Whether a prompt that arrived at ``arrived`` goes by its arrival: in arrival
        order, or once it has waited ``max_wait_s``."""
        return not self.shortest or now - arrived >= self.max_wait_s

    def rank(self, tokens: int, arrived: float, now: float) -> Rank:
        """Of a prompt with ``tokens`` left to compute that arrived at ``arrived``: an
        aged one by its arrival, before every other by its tokens, then its arrival."""
        if self.aged(arrived, now):
            return (0, arrived, 0.0)
        return (1, float(tokens), arrived)
