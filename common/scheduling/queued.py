"""The prompts queued on a shortest-first prefill instance, as its wait prediction asks
about them (``PrefillInstanceState.wait_s``): the seconds of those no longer than a new
prompt, and the next longer one (the prompt computing while the new one waits).

Built once per queue (sorted by tokens, with prefix sums), then asked in O(log) per new
prompt: the conductor asks every prefill instance at every decision, and a pass over each
queue made a decision cost what all the queues held (``benchmarks/conductor_scale.py``:
with 2,000 queued on 32 workers, a decision took 14-16 ms, 1.9-2.1 now). Two things
change with time, not with the queue, and are set per decision by ``at``: the oldest
prompts that have waited ``prefill_max_wait_s`` go by their arrival (they count as 0
tokens: ahead of every new prompt), and the prompt computing now has part of its seconds
done. And the cost model's live correction (``Scales``), which the online calibration
refits every few prefills: the entries are the profile's seconds, scaled when asked, so
a refit does not price every queue again.
"""
from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from typing import Optional, Sequence

from common.scheduling.cost import Scales


class QueuedPrompts:
    """``entries``: each queued prompt's (tokens to compute, predicted seconds by the
    profile, unscaled), oldest first."""

    def __init__(self, entries: Sequence[tuple[int, float]]) -> None:
        self.tokens = [tokens for tokens, _ in entries]
        self.profile = [seconds for _, seconds in entries]
        self._order = sorted(range(len(entries)), key=lambda i: entries[i])  # by tokens
        self._sorted_tokens = [self.tokens[i] for i in self._order]
        self._prefix = [0.0, *accumulate(self.profile[i] for i in self._order)]
        self.scales = Scales()
        self.aged = 0  # how many of the oldest go by their arrival (as 0 tokens)
        self.first: Optional[int] = None  # the one computing, with ``first_s`` left
        self.first_s = 0.0

    def __len__(self) -> int:
        return len(self.tokens)

    def at(self, scales: Scales, aged: int = 0, first: Optional[int] = None,
           first_s: float = 0.0) -> "QueuedPrompts":
        """The queue at a moment: priced with ``scales``, its ``aged`` oldest prompts go
        by their arrival, and ``first`` (an index, oldest first) has ``first_s`` of its
        seconds left. A view: the sorted entries are shared, not copied."""
        view = object.__new__(QueuedPrompts)
        view.__dict__.update(self.__dict__)  # copy.copy's work, at a fifth of its cost
        view.scales, view.aged, view.first, view.first_s = scales, aged, first, first_s
        return view

    def seconds(self, i: int) -> float:
        """The ``i``-th oldest's seconds left."""
        if i == self.first:
            return self.first_s
        return self.scales.of_tokens(self.tokens[i]) * self.profile[i]

    def left_s(self) -> float:
        """The seconds left of all of them."""
        return self._sum_below(len(self._order)) + self._first_done(True)

    def entries(self) -> tuple[tuple[int, float], ...]:
        """Each one's (tokens, seconds) as the prediction counts them, oldest first."""
        return tuple((0 if i < self.aged else tokens, self.seconds(i))
                     for i, tokens in enumerate(self.tokens))

    def ahead_s(self, new_tokens: int) -> float:
        """The seconds of the prompts a new one of ``new_tokens`` waits for: those of no
        more tokens, and those gone by their arrival."""
        total = self._sum_below(bisect_right(self._sorted_tokens, new_tokens))
        total += sum(self._full(i) for i in range(self.aged) if self.tokens[i] > new_tokens)
        first = self.first
        return total + self._first_done(
            first is not None and (first < self.aged or self.tokens[first] <= new_tokens))

    def next_longer(self, new_tokens: int) -> Optional[tuple[int, float]]:
        """(tokens, seconds) of the least prompt of more than ``new_tokens``, by tokens
        then seconds, of those going by their tokens; None if there is none."""
        for p in range(bisect_right(self._sorted_tokens, new_tokens), len(self._order)):
            i = self._order[p]
            if i < self.aged:
                continue
            best = (self.tokens[i], self.seconds(i))
            first = self.first
            if first is not None and first >= self.aged and \
                    self.tokens[first] == best[0]:  # less done may put it first
                best = min(best, (self.tokens[first], self.first_s))
            return best
        return None

    def _full(self, i: int) -> float:
        return self.scales.of_tokens(self.tokens[i]) * self.profile[i]

    def _first_done(self, counted: bool) -> float:
        """What to add to a sum that counted the first one whole: less its part done."""
        if not counted or self.first is None:
            return 0.0
        return self.first_s - self._full(self.first)

    def _sum_below(self, p: int) -> float:
        """The scaled seconds of the ``p`` fewest-token prompts: the short ones (a prefix
        of them, by tokens) by their scale, the rest by the other."""
        s = self.scales
        if s.short is None:
            return s.long * self._prefix[p]
        k = min(p, bisect_right(self._sorted_tokens, s.short_tokens))
        return s.short * self._prefix[k] + s.long * (self._prefix[p] - self._prefix[k])
