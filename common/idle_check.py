"""A pool's invariants, checked while its process is idle.

Every pool has an exact ``check_integrity`` (raises AssertionError). A worker's KV block
pool is checked with ``BlockPool.check_idle`` (its invariants, and no block referenced
while nothing is queued, running or in flight); the store master's metadata with
``StoreMetadata.check_integrity``. A violation is a leak or a double free in the
bookkeeping, found at the first idle moment instead of as a full pool hours later. A check
walks the whole pool, so it runs only while the process says it is idle, sampled once per
``interval_s`` (``watch``), apart from its steps: under load it costs nothing and the step
loops are untouched. A violation is logged as an error and counted; ``strict`` (tests)
raises it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

IDLE_CHECK_INTERVAL_S = 10.0


class IdleCheck:
    def __init__(self, check: Callable[[], None], what: str,
                 interval_s: float = IDLE_CHECK_INTERVAL_S, strict: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.check = check
        self.what = what
        self.interval_s = interval_s
        self.strict = strict
        self.clock = clock
        self.checks = 0
        self.violations = 0
        self._last: Optional[float] = None

    def run(self) -> bool:
        """Check now unless a check ran less than ``interval_s`` ago; True if it ran.
        Call only when the process is idle."""
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            return False
        self._last = now
        self.checks += 1
        try:
            self.check()
        except AssertionError as exc:
            self.violations += 1
            log.error("%s integrity violated (violation %d): %s", self.what, self.violations,
                      exc)
            if self.strict:
                raise
        return True

    async def watch(self, idle: Callable[[], bool]) -> None:
        """Forever: every ``interval_s``, check if the process says it is ``idle()``."""
        while True:
            await asyncio.sleep(self.interval_s)
            if idle():
                self.run()
