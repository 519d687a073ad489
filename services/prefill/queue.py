"""The prompts waiting on a prefill worker, oldest first, each holding its cached prefix.

The conductor prices a prompt placed here by what this worker caches at that instant
(its KV events), so a prefix cached at placement must still be cached at admission. It
was not always: at 2 req/s a prompt queued 20-30 s while the prompts ahead filled the pool
and evicted the prefix it was priced as reusing (5 of 100 predictions of the live replay
off by 2-5x). So a queued prompt references the leading blocks of its prompt that the
pool holds when it arrives, as a running prompt would, and drops them when it leaves the
queue: admitted (its admission referenced them again), aborted, fenced off or failed.

Held prefixes are capped at ``cap`` distinct blocks (half the pool by default), so that
the prompts ahead always have room; a prompt arriving over the cap holds nothing and
reuses what is still there when it is admitted, as before. A pool that cannot hold the
oldest prompt while nothing computes drops every hold and takes none (``release_all``)
until a prompt is admitted (``resume``), before it fails.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Iterable, Iterator, Optional

from common.kv.block_pool import BlockPool
from common.protocol import Fence, PrefillTask
from services.prefill.job import Job


class PromptQueue:
    def __init__(self, pool: BlockPool, block_size: int, cap: Optional[int] = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.cap = pool.num_blocks // 2 if cap is None else cap
        self._tasks: deque[PrefillTask] = deque()
        self._held: dict[Fence, list[int]] = {}  # a task's referenced prefix blocks
        self._holders: Counter[int] = Counter()  # block -> how many tasks hold it
        self.holding = True  # False from ``release_all`` to ``resume``

    # ---- the queue ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[PrefillTask]:
        return iter(self._tasks)

    def append(self, task: PrefillTask) -> None:
        """Queue ``task`` last, holding its cached prefix (within the cap)."""
        self._hold(task)
        self._tasks.append(task)

    def appendleft(self, task: PrefillTask) -> None:
        """Put back the oldest prompt, which could not be admitted yet (it holds its
        prefix again: its admission attempt dropped its hold)."""
        self._hold(task)
        self._tasks.appendleft(task)

    def popleft(self) -> PrefillTask:
        """The oldest prompt, out for admission. It keeps holding its prefix until
        ``release(task)``, once its admission has referenced the blocks itself (or
        could not)."""
        return self._tasks.popleft()

    def drop(self, which: Callable[[PrefillTask], bool]) -> list[PrefillTask]:
        """The queued prompts ``which`` names leave the queue without being admitted
        (aborted, fenced off): their holds are dropped."""
        gone = [task for task in self._tasks if which(task)]
        for task in gone:
            self._tasks.remove(task)
            self.release(task)
        return gone

    def ready(self, jobs: Iterable[Job]) -> bool:
        """A prompt waits, and the oldest need not wait for one of ``jobs`` (admitted,
        its blocks not yet published) that computes the first block of its prompt that
        the pool does not hold: it waits for that job rather than computing the prefix
        twice (one system prompt arriving twice at once: a replay at 2 req/s recomputed
        7 such prefixes, 15 s of a 25 s queue, and the conductor prices them as cached).
        Keys are chained: the same key is the same prefix."""
        if not self._tasks:
            return False
        keys = self._prefix_keys(self._tasks[0])
        if keys is None:
            return True
        first = self.pool.peek_prefix(keys)
        return first >= len(keys) or not any(
            first < len(j.keys) and j.keys[first] == keys[first] for j in jobs)

    # ---- holds --------------------------------------------------------------------
    @property
    def held_blocks(self) -> int:
        """Distinct blocks held by queued prompts."""
        return len(self._holders)

    def release(self, task: PrefillTask) -> None:
        blocks = self._held.pop(task.fence, None)
        if blocks is None:
            return
        self.pool.free(blocks)
        for block in blocks:
            self._holders[block] -= 1
            if not self._holders[block]:
                del self._holders[block]

    def release_all(self) -> bool:
        """Drop every hold and take none until ``resume``; whether there was any."""
        held, self.holding = bool(self._held), False
        for blocks in self._held.values():
            self.pool.free(blocks)
        self._held.clear()
        self._holders.clear()
        return held

    def resume(self) -> None:
        """A prompt was admitted: prompts arriving from now on hold their prefixes."""
        self.holding = True

    def _prefix_keys(self, task: PrefillTask) -> Optional[list[bytes]]:
        """The block keys whose cached prefix ``task`` reuses; None if it reuses none
        (prompt logprobs need every row) or its keys do not fit (its admission says so)."""
        if task.sampling.prompt_logprobs is not None:
            return None
        try:
            return task.keys(self.block_size)
        except ValueError:
            return None

    def _hold(self, task: PrefillTask) -> None:
        keys = self._prefix_keys(task)
        if not self.holding or task.fence in self._held or keys is None:
            return  # the pool is short, held already, or it reuses no prefix
        cached = self.pool.cached_prefix(keys)
        new = sum(1 for block in cached if block not in self._holders)
        if not cached or self.held_blocks + new > self.cap:
            return
        blocks = self.pool.match_prefix(keys[:len(cached)])
        self._held[task.fence] = blocks
        self._holders.update(blocks)
