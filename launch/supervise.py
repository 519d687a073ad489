"""When ``crescent up`` restarts a child that exited on its own: the pure policy.

A child that exits while the cluster runs is started again (same role, index, CPU plan and
log file) after a back-off that doubles with each restart of that child in the last minute
(``backoff_s``, ``2 * backoff_s``, ... capped at ``max_backoff_s``). A child that exits more
than ``max_restarts_per_minute`` times within a minute is crash-looping: the cluster stops
with that child's name in the message rather than restart it forever. An exit code of 2
(a bad config or argument, common/service.py) cannot heal by itself and stops the cluster
at once. No processes, no clock of its own: ``launch/cluster.py`` calls it with the time.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Union

from common.config import SuperviseConfig

WINDOW_S = 60.0
BAD_CONFIG = 2  # the bootstrap's exit code for a bad config or argument


@dataclass(frozen=True)
class Restart:
    """Start ``name`` again ``delay_s`` after its exit; its ``attempt``-th restart."""

    name: str
    exit_code: int
    attempt: int
    delay_s: float

    def __str__(self) -> str:
        return (f"{self.name} exited with code {self.exit_code}; restart {self.attempt} "
                f"in {self.delay_s:g} s")


@dataclass(frozen=True)
class GiveUp:
    """Stop the cluster: ``name`` cannot be kept running."""

    name: str
    exit_code: int
    reason: str

    def __str__(self) -> str:
        return f"{self.name} exited with code {self.exit_code}: {self.reason}"


Decision = Union[Restart, GiveUp]


class RestartPolicy:
    """Per child, the times of its restarts in the last minute decide the next move."""

    def __init__(self, config: SuperviseConfig) -> None:
        self.config = config
        self._recent: dict[str, deque[float]] = {}
        self.attempts: dict[str, int] = {}  # restarts ever decided, per child

    def on_exit(self, name: str, exit_code: int, now: float) -> Decision:
        """The child ``name`` exited with ``exit_code`` at ``now`` (seconds, monotonic)."""
        c = self.config
        if not c.restart:
            return GiveUp(name, exit_code, "restarts are off ([supervise] restart = false)")
        if exit_code == BAD_CONFIG:
            return GiveUp(name, exit_code, "a bad config or argument; not restarting")
        recent = self._recent.setdefault(name, deque())
        while recent and now - recent[0] >= WINDOW_S:
            recent.popleft()
        if len(recent) >= c.max_restarts_per_minute:
            return GiveUp(name, exit_code, (
                f"crash loop: restarted {len(recent)} times in the last {WINDOW_S:g} s "
                f"([supervise] max_restarts_per_minute = {c.max_restarts_per_minute})"))
        delay = min(c.max_backoff_s, c.backoff_s * 2 ** len(recent))
        recent.append(now)
        self.attempts[name] = self.attempts.get(name, 0) + 1
        return Restart(name, exit_code, self.attempts[name], delay)
