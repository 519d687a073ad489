"""Layer-wise store puts, committed per step.

The head asks the store master for the objects each chunk completes (one ``start_put`` per
chunk: a chunk's objects are written within the plan's deadline, so a long prompt never
outlives its grant). It asks one step ahead: while step s computes, the grants for the
chunks step s + 1 is predicted to compute are on their way (a master round trip per step
was ~1.4 ms of wait on this 2-core host); a prompt's first chunk is asked for during its
admission. Prompts are planned oldest first, so a new one
never changes an older one's next chunk; one that did not go as predicted (a prompt ahead
of it left) gives its grant back unwritten and asks again. During the step every stage
writes its layers of them, layer by layer (services/prefill/layer_io.py). After it, the head commits (two-phase
put: ``end_put``) each object that every stage wrote; anything else is reclaimed by the
master, and a reader never sees a half-written object.

``blocks_completed`` is the pure rule for which blocks a chunk completes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Coroutine, Hashable, Optional, Sequence

from common.engine.batching import plan_chunks
from services.prefill.stage_protocol import StageStored
from common.transfer import watched
from services.prefill.job import Job
from services.prefill.layer_io import PartIO

if TYPE_CHECKING:
    from common.store.client import StoreClient
    from common.store.plans import PutPlan

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
    def __init__(self, store: "StoreClient", followers: int, block_size: int,
                 object_nbytes: int) -> None:
        self.store = store
        self.followers = followers  # stages after the head; each reports StageStored
        self.block_size = block_size
        self.object_nbytes = object_nbytes
        self.pending: dict[int, Pending] = {}
        self.tasks: set[asyncio.Task] = set()
        self.committed = 0
        self.failed = 0
        self.down_until = 0.0  # monotonic: the master did not answer; ask again after
        # grants asked ahead: owner (a prompt's fence) → (its blocks, the pending grant)
        self.ahead: dict[Hashable, tuple[range, asyncio.Future]] = {}

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

    def _new_blocks(self, job: Job, start: int, end: int) -> range:
        """The blocks the chunk [start, end) of ``job`` completes and the store lacks."""
        return blocks_completed(start, end, self.block_size,
                                range(job.plan.stored_from, len(job.keys)))

    async def grant_part(self, job: Job, part: PartIO) -> None:
        """Give ``part`` (a chunk of ``job``) the grant for the objects it completes: the
        one asked ahead if the prediction held (usually arrived already), else ask now
        (rare: a prompt ahead of it in the step left)."""
        blocks = self._new_blocks(job, part.start, part.end)
        held = self.ahead.pop(job.task.fence, None)
        plan = await held[1] if held is not None else None
        if held is not None and held[0] != blocks:  # overlapping: give it back first
            if plan is not None:
                await self.store.end_put(plan, [False] * len(plan.keys))
            held = None
        if held is None:
            plan = await self.plan(job.keys[blocks.start:blocks.stop], self.object_nbytes)
        if plan is not None:
            part.put = plan
            part.put_local = [job.plan.block_table[blocks.start + i] for i in plan.index]
            part.put_blocks = [blocks.start + i for i in plan.index]

    def ask_ahead(self, jobs: Sequence[Job], budget: int,
                  planned: Sequence[tuple[Job, int]], align: int = 0) -> None:
        """Start asking now for the grants of the chunks the step after ``planned`` is
        predicted to compute (``plan_chunks``, if no prompt is admitted meanwhile)."""
        live = {job.task.fence for job in jobs}
        for gone in [owner for owner in self.ahead if owner not in live]:
            self.forget(gone)
        computing = {id(job): job.done + n for job, n in planned}
        for job, n in plan_chunks(jobs, budget, planned, align):
            start = computing.get(id(job), job.done)
            blocks = self._new_blocks(job, start, start + n)
            self._ask(job.task.fence, job.keys, blocks if job.failed is None else range(0))

    def ask_first(self, owner: Hashable, keys: list[bytes], stored_from: int, start: int,
                  prompt_len: int, budget_left: int) -> None:
        """Start asking for the grant of a prompt's first chunk (from ``start``, within the
        ``budget_left`` of the next step) while its admission goes on (its KV stream opens,
        its loads launch), so that its first step does not wait a master round trip for it
        (2-4 ms of a warm prompt's TTFT on an H200 host). ``grant_part`` uses it if the
        step computes that chunk."""
        end = start + max(0, min(prompt_len - start, budget_left))
        self._ask(owner, keys, blocks_completed(start, end, self.block_size,
                                                range(stored_from, len(keys))))

    def _ask(self, owner: Hashable, keys: list[bytes], blocks: range) -> None:
        """``owner``'s grant for ``blocks`` (of its ``keys``), asked now, replacing any."""
        self.forget(owner)
        if blocks:
            self.ahead[owner] = (blocks, asyncio.ensure_future(
                self.plan(keys[blocks.start:blocks.stop], self.object_nbytes)))

    def forget(self, owner: Hashable) -> None:
        """``owner`` will not use what was asked ahead for it (it failed or left)."""
        held = self.ahead.pop(owner, None)
        if held is not None:
            self._give_back(held[1])

    def _give_back(self, pending: asyncio.Future) -> None:
        """An unused grant: end it with nothing written, so the master frees its space and
        another writer may put those objects at once (not after the grant's deadline)."""
        def settled(fut: asyncio.Future) -> None:
            plan = None if fut.cancelled() else fut.result()  # plan() never raises
            if plan is not None:
                self._spawn(self.store.end_put(plan, [False] * len(plan.keys)))
        pending.add_done_callback(settled)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def step_done(self, step: int, parts: list[PartIO]) -> None:
        """The head computed step ``step``: commit its puts once they are written."""
        parts = [p for p in parts if p.put is not None]
        if not parts:
            return
        entry = Pending(parts, [], asyncio.Event())
        if self.followers == 0:
            entry.reported.set()
        self.pending[step] = entry
        self._spawn(self._commit(step, entry))

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
            futures = [watched(f) for p in entry.parts for f in p.put_futures]
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
        for owner in list(self.ahead):
            self.forget(owner)
        await asyncio.sleep(0)  # grants that arrived already are given back
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
