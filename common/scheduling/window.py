"""The prompts placed on a prefill instance lately, as the shortest-first prediction asks
about them (``PrefillInstanceState.wait_s``): how many seconds of compute were placed in
the last ``RECENT_WINDOW_S`` by prompts shorter than a given one.

The conductor asks this of every prefill instance at every decision. A pass over the
window made the question cost what the window holds: at 200 placements a second over
32 instances, 4,000 prompts, 0.7 ms of each decision (``benchmarks/conductor_scale.py``).
Here the seconds are summed by token count as prompts are placed and age out, in a
Fenwick tree over bins of ``BIN_TOKENS`` tokens, with each bin's own token counts kept
exactly: a question costs O(log) of the longest prompt seen, and the answer is the pass's
(up to the order floats are added in).
"""
from __future__ import annotations

from collections import deque
from typing import Iterable

RECENT_WINDOW_S = 20.0  # the placements the prediction looks back on
BIN_TOKENS = 16


class PlacedWindow:
    """(tokens, predicted compute seconds) of the prompts placed in the last ``window_s``,
    oldest first; ``add`` in the order of their times."""

    def __init__(self, window_s: float = RECENT_WINDOW_S) -> None:
        self.window_s = window_s
        self._placed: deque[tuple[float, int, float]] = deque()  # (at, tokens, seconds)
        self._tree = [0.0] * 65  # 1-based Fenwick tree over bins: 64 bins to start
        self._bins: dict[int, dict[int, list]] = {}  # bin → tokens → [seconds, count]

    @classmethod
    def of(cls, entries: Iterable[tuple[int, float]], at: float = 0.0) -> "PlacedWindow":
        """A window holding ``entries`` (tokens, seconds), all placed at ``at``."""
        window = cls()
        for tokens, seconds in entries:
            window.add(at, tokens, seconds)
        return window

    def __len__(self) -> int:
        return len(self._placed)

    def entries(self) -> tuple[tuple[int, float], ...]:
        """(tokens, seconds) of each prompt in the window, oldest first."""
        return tuple((tokens, seconds) for _, tokens, seconds in self._placed)

    def add(self, at: float, tokens: int, seconds: float) -> None:
        self._placed.append((at, tokens, seconds))
        self._count(tokens, seconds, 1)

    def expire(self, now: float) -> None:
        """Forget the prompts placed ``window_s`` or more before ``now``."""
        placed = self._placed
        while placed and placed[0][0] <= now - self.window_s:
            _, tokens, seconds = placed.popleft()
            self._count(tokens, -seconds, -1)
        if not placed:  # what adding and taking away left of the float sums
            self._tree = [0.0] * len(self._tree)

    def seconds_below(self, tokens: int) -> float:
        """Compute seconds placed by prompts of fewer than ``tokens`` tokens."""
        if not self._placed:
            return 0.0
        b = tokens // BIN_TOKENS
        total, i = 0.0, min(b, len(self._tree) - 1)  # the bins before ``tokens``' bin
        while i > 0:
            total += self._tree[i]
            i -= i & -i
        for t, (seconds, _) in self._bins.get(b, {}).items():
            if t < tokens:
                total += seconds
        return max(total, 0.0)

    def _count(self, tokens: int, seconds: float, count: int) -> None:
        b = tokens // BIN_TOKENS
        exact = self._bins.setdefault(b, {})
        entry = exact.setdefault(tokens, [0.0, 0])
        entry[0] += seconds
        entry[1] += count
        if entry[1] == 0:
            del exact[tokens]
            if not exact:
                del self._bins[b]
        if b + 1 >= len(self._tree):
            self._grow(b)
        else:
            i = b + 1
            while i < len(self._tree):
                self._tree[i] += seconds
                i += i & -i

    def _grow(self, b: int) -> None:
        """Rebuild the tree with room for bin ``b`` (doubling: O(bins) once in a while)."""
        size = len(self._tree) - 1
        while size <= b:
            size *= 2
        tree = [0.0] * (size + 1)
        for bin_, exact in self._bins.items():
            tree[bin_ + 1] += sum(seconds for seconds, _ in exact.values())
        for i in range(1, size + 1):  # each node passes its sum to its parent
            parent = i + (i & -i)
            if parent <= size:
                tree[parent] += tree[i]
        self._tree = tree
