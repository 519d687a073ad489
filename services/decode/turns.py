"""Which running sequences a decode step serves when more run than fit in one batch.

A batch holds at most ``max_batch`` sequences. Taking the first ``max_batch`` every step
would starve the rest until one of those finished; instead sequences take turns: the ones
just served go to the back of the line, sequences that joined since the last step queue
behind everyone already waiting. With a steady set of n sequences each one waits at most
ceil(n / max_batch) - 1 steps between two of its own, and no sequence is served twice
before every other has been served once. Pure: request ids in, request ids out.
"""
from __future__ import annotations

from typing import Iterable


class Turns:
    def __init__(self) -> None:
        self._line: list[str] = []  # the order in which sequences get their next step

    def next_batch(self, running: Iterable[str], max_batch: int) -> list[str]:
        """The ids to step now, given the ids running now (in their arrival order)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        live = dict.fromkeys(running)
        line = [rid for rid in self._line if rid in live]
        waiting = set(line)
        line += [rid for rid in live if rid not in waiting]
        batch = line[:max_batch]
        self._line = line[max_batch:] + batch
        return batch

    def __len__(self) -> int:
        return len(self._line)
