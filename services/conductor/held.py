"""Requests waiting for a worker: none of a role they need is live, and a supervised
restart (or another worker) may be on its way. The conductor holds a new request that
finds no worker, and a re-run whose worker was lost with none to take it, for at most
``worker_wait_s``; it tries them again whenever a worker registers and on every sweep
(``Conductor.place_held``), oldest first, and fails those whose wait is over."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from common.protocol import SubmitRequest

log = logging.getLogger("conductor")


@dataclass
class Held:
    """A request waiting for a worker: placed when one registers, or failed at ``until``."""

    req: SubmitRequest
    until: float  # time.monotonic()
    attempt: int = 0  # placements before this one (a re-run's is 1)
    accepted_at: Optional[float] = None  # None: the router was not told it was accepted
    store_loads: bool = True


class HeldRequests:
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s  # worker_wait_s: 0 holds nothing
        self.requests: dict[str, Held] = {}  # oldest first

    def __len__(self) -> int:
        return len(self.requests)

    def hold(self, req: SubmitRequest, attempt: int = 0, accepted_at: Optional[float] = None,
             store_loads: bool = True) -> bool:
        """Keep ``req`` for at most ``wait_s``; False where waiting is off."""
        if self.wait_s <= 0:
            return False
        log.info("%s waits up to %g s for a prefill and a decode worker", req.request_id,
                 self.wait_s)
        self.requests[req.request_id] = Held(req, time.monotonic() + self.wait_s, attempt,
                                             accepted_at, store_loads)
        return True

    def pop(self, request_id: str) -> Optional[Held]:
        return self.requests.pop(request_id, None)

    def expired(self, now: float) -> list[Held]:
        """Remove and return the requests whose wait is over."""
        over = [h for h in self.requests.values() if now > h.until]
        for h in over:
            del self.requests[h.req.request_id]
        return over

    def oldest_first(self) -> list[Held]:
        return list(self.requests.values())
