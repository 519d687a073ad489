"""The prompts waiting on a prefill worker, in the order it computes them
(common/scheduling/prefill_order.py ``PromptOrder``), each holding its cached prefix.

A worker computes the prompt with the fewest tokens left to compute first (a shortest-
remaining-first order, at step granularity: a new short prompt joins the next step ahead
of a long one's further chunks) and, among equals, the oldest. On the conversation
trace 70 % of the prompts compute under 100 tokens after their cached prefix and a
quarter compute 400-1,800: in arrival order the short ones queued for whole long prompts
on a one-core prefill worker. Shortest first, the live replay's goodput (TTFT 2 s, TBT
0.5 s) went from 61 to 83 of 100 at 1 req/s and from 18 to 62 at 2 (BENCHMARKS.md). So
that a long prompt is not put off for ever under a steady stream of short ones, a prompt
that has waited ``max_wait_s`` goes before every younger one, oldest first.
``shortest = False``: arrival order throughout.

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

import time
from collections import Counter
from typing import Callable, Iterable, Iterator, Optional

from common.config import ClusterConfig
from common.kv.block_pool import BlockPool
from common.protocol import Fence, PrefillTask
from common.scheduling.prefill_order import PromptOrder, Rank
from services.prefill.job import Job


class PromptQueue:
    def __init__(self, pool: BlockPool, block_size: int, cap: Optional[int] = None,
                 order: Optional[PromptOrder] = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.cap = pool.num_blocks // 2 if cap is None else cap
        self.order = PromptOrder.of(ClusterConfig()) if order is None else order
        self._tasks: list[tuple[float, PrefillTask]] = []  # (arrival, task), by arrival
        self._held: dict[Fence, list[int]] = {}  # a task's referenced prefix blocks
        self._holders: Counter[int] = Counter()  # block -> how many tasks hold it
        self.holding = True  # False from ``release_all`` to ``resume``

    # ---- the queue ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[PrefillTask]:
        return (task for _, task in self._tasks)

    def append(self, task: PrefillTask, arrived: Optional[float] = None) -> None:
        """Queue ``task``, arrived now (or at ``arrived``: one put back after its
        admission found no room), holding its cached prefix (within the cap)."""
        self._hold(task)
        self._tasks.append((time.monotonic() if arrived is None else arrived, task))
        self._tasks.sort(key=lambda entry: entry[0])

    def take(self, task: PrefillTask) -> float:
        """``task`` (from ``next``) out for admission; its arrival. It keeps holding its
        prefix until ``release(task)``, once its admission has referenced the blocks
        itself (or could not)."""
        for i, (arrived, queued) in enumerate(self._tasks):
            if queued is task:
                del self._tasks[i]
                return arrived
        raise KeyError(task.request_id)

    def drop(self, which: Callable[[PrefillTask], bool]) -> list[PrefillTask]:
        """The queued prompts ``which`` names leave the queue without being admitted
        (aborted, fenced off): their holds are dropped."""
        gone = [task for task in self if which(task)]
        self._tasks = [(arrived, task) for arrived, task in self._tasks
                       if not any(task is g for g in gone)]
        for task in gone:
            self.release(task)
        return gone

    def next(self, jobs: Iterable[Job], now: Optional[float] = None,
             most: Optional[int] = None) -> Optional[tuple[PrefillTask, Rank]]:
        """The first prompt by the order (its tokens: what the pool does not hold) that
        is ready, and its rank; None if none is. ``most``: of the prompts of at most that
        many tokens (a preempting step's, preempt.py).

        A prompt is not ready while one of ``jobs`` (admitted, its blocks not yet
        published) computes the first block of its prompt that the pool does not hold:
        it waits for that job rather than computing the prefix twice (one system prompt
        arriving twice at once: a replay at 2 req/s recomputed 7 such prefixes, 15 s of
        a 25 s queue, and the conductor prices them as cached). Keys are chained: the
        same key is the same prefix."""
        now = time.monotonic() if now is None else now
        jobs = list(jobs)
        ranked = []
        for arrived, task in self._tasks:
            keys = self._prefix_keys(task)
            first = self.pool.peek_prefix(keys) if keys is not None else 0
            tokens = len(task.token_ids) - min(first * self.block_size, len(task.token_ids) - 1)
            if most is not None and tokens > most:
                continue
            ranked.append((self.order.rank(tokens, arrived, now), task, keys, first))
        for rank, task, keys, first in sorted(ranked, key=lambda r: r[0]):
            if keys is None or first >= len(keys) or not any(
                    first < len(j.keys) and j.keys[first] == keys[first] for j in jobs):
                return task, rank
        return None

    def waited(self, now: float, seconds: float, jobs: Iterable[Job] = ()) -> bool:
        """Whether a queued prompt, or one of ``jobs``, has waited ``seconds`` by ``now``."""
        return any(now - arrived >= seconds for arrived, _ in self._tasks) or any(
            now - job.arrived >= seconds for job in jobs)

    # ---- the admitted prompts, in the same order --------------------------------
    def sort(self, jobs: Iterable[Job]) -> list[Job]:
        """Admitted prompts in the order their chunks take a step's budget."""
        now = time.monotonic()
        return sorted(jobs, key=lambda j: self.order.rank(j.remaining, j.arrived, now))

    def tokens_before(self, jobs: Iterable[Job], rank: Rank) -> int:
        """Tokens left to those of ``jobs`` that come before a prompt of ``rank``."""
        now = time.monotonic()
        return sum(j.remaining for j in jobs
                   if self.order.rank(j.remaining, j.arrived, now) < rank)

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
