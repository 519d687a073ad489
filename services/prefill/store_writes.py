"""Layer-wise store puts, committed per step.

Before a step, the head asks the store master for the objects each chunk completes (one
``start_put`` per chunk: a chunk's objects are written within the plan's deadline, so a
long prompt never outlives its grant). During the step every stage writes its layers of
them, layer by layer (services/prefill/layer_io.py). After it, the head commits (two-phase
put: ``end_put``) each object that every stage wrote; anything else is reclaimed by the
master, and a reader never sees a half-written object.

``blocks_completed`` is the pure rule for which blocks a chunk completes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from common.stage_protocol import StageStored
from services.prefill.layer_io import PartIO

if TYPE_CHECKING:
    from common.store.client import StoreClient
    from common.store.ranges import PutPlan

log = logging.getLogger("prefill.store")

PLAN_TIMEOUT_S = 1.0  # a step waits at most this for its grants
BACKOFF_S = 5.0  # then puts pause this long


def blocks_completed(start: int, end: int, block_size: int, put: range) -> range:
    """Blocks of ``put`` whose last token is in [start, end): block i holds tokens
    [i * bs, (i + 1) * bs), so the chunk completes i when start < (i + 1) * bs <= end."""
    first, stop = start // block_size, end // block_size
    return range(max(first, put.start), min(stop, put.stop))


@dataclass
class Pending:
    """One step's puts: the head's own parts, and what the followers reported."""

    parts: list[PartIO]
    remote: list[list[bool]]
    reported: asyncio.Event


class StoreWrites:
    def __init__(self, store: "StoreClient", followers: int) -> None:
        self.store = store
        self.followers = followers  # stages after the head; each reports StageStored
        self.pending: dict[int, Pending] = {}
        self.tasks: set[asyncio.Task] = set()
        self.committed = 0
        self.failed = 0
        self.down_until = 0.0  # monotonic: the master did not answer; ask again after

    async def plan(self, keys: list[bytes], size: int) -> Optional["PutPlan"]:
        """The grant for ``keys`` (None: none new, or the master did not answer). Asked
        before a step, so it never waits long: a master that does not answer within
        ``PLAN_TIMEOUT_S`` is not asked again for ``BACKOFF_S`` (those blocks are simply
        not stored; a late grant is reclaimed by the master)."""
        if not keys or time.monotonic() < self.down_until:
            return None
        try:
            plan = await asyncio.wait_for(self.store.start_put(keys, size), PLAN_TIMEOUT_S)
        except Exception as exc:  # the store is optional for correctness
            log.warning("store put start failed (%s): not storing for %.0fs",
                        type(exc).__name__, BACKOFF_S)
            plan = None
        if plan is None:
            self.down_until = time.monotonic() + BACKOFF_S
            return None
        return plan if plan.keys else None

    def step_done(self, step: int, parts: list[PartIO]) -> None:
        """The head computed step ``step``: commit its puts once they are written."""
        parts = [p for p in parts if p.put is not None]
        if not parts:
            return
        entry = Pending(parts, [], asyncio.Event())
        if self.followers == 0:
            entry.reported.set()
        self.pending[step] = entry
        task = asyncio.create_task(self._commit(step, entry))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def on_stored(self, msg: StageStored) -> None:
        entry = self.pending.get(msg.step)
        if entry is None:
            return
        entry.remote.append(list(msg.written))
        if len(entry.remote) >= self.followers:
            entry.reported.set()

    async def _commit(self, step: int, entry: Pending) -> None:
        deadline = max(p.put.deadline for p in entry.parts if p.put is not None)
        try:
            futures = [asyncio.wrap_future(f) for p in entry.parts for f in p.put_futures]
            left = max(0.0, deadline - time.time()) + 1.0
            if futures:
                await asyncio.wait(futures, timeout=left)
            try:
                await asyncio.wait_for(entry.reported.wait(), max(0.0, deadline - time.time()) + 1.0)
            except asyncio.TimeoutError:
                log.warning("step %d: %d of %d stages reported their store writes in time",
                            step, len(entry.remote), self.followers)
            written: list[bool] = [w for p in entry.parts for w in p.written()]
            for remote in entry.remote:
                if len(remote) == len(written):
                    written = [a and b for a, b in zip(written, remote)]
            if len(entry.remote) < self.followers:
                written = [False] * len(written)
            at = 0
            for part in entry.parts:
                assert part.put is not None
                n = len(part.put.keys)
                stored = await self.store.end_put(part.put, written[at:at + n])
                self.committed += stored
                self.failed += n - stored
                at += n
        except Exception:
            log.exception("step %d: store commit failed", step)
        finally:
            self.pending.pop(step, None)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
