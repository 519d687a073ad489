"""A prefill worker's steps, as planned by it (service.py): each computed on its compute
thread with its chunks' KV I/O (layer_io.py), store grants (store_writes.py) and, in a
pipeline group, handed to the next stage. A regular step may be preempted at a layer
boundary by a short prompt's step (preempt.py), which runs here too."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from common import timeline
from common.engine.config import PrefillChunk
from common.engine.errors import EngineInputError
from common.engine.prompt_logprobs import chunk_logprobs
from common.worker import WorkerRuntime, fail_step
from services.prefill.job import Job
from services.prefill.lanes import PrefillThreads
from services.prefill.layer_io import PartIO, StepIO, check_loads
from services.prefill.preempt import LayerPreemption

if TYPE_CHECKING:
    from common.store.ranges import RangeMover
    from services.prefill.group import HeadGroup
    from services.prefill.store_writes import StoreWrites

Planned = list[tuple[Job, int]]  # (prompt, tokens of it) in one step
Ended = list[tuple[Job, Optional[torch.Tensor]]]  # prompts a step ended, their last logits


class PrefillSteps:
    def __init__(self, rt: WorkerRuntime, threads: PrefillThreads, mover: Optional["RangeMover"],
                 store_writes: Optional["StoreWrites"], group: Optional["HeadGroup"],
                 budget: int, align: int) -> None:
        self.rt, self.engine, self.threads, self.mover = rt, rt.engine, threads, mover
        self.store_writes, self.group = store_writes, group
        self.budget, self.align = budget, align
        self.block_size = self.engine.config.block_size
        self.count = 0  # steps computed (a step's id for its store commit and its stages)
        self.preempt = LayerPreemption(threads.compute)
        self.preemptible = False  # a regular step computes that a short prompt may preempt

    async def run(self, planned: Planned, computing: Sequence[Job] = (),
                  preemptible: bool = False, preempting: bool = False) -> Ended:
        """A step over ``planned``; the prompts it ended (their last chunk ran, not aborted
        or failed). A regular step asks ahead for the store grants of the step predicted
        to follow it over ``computing``; ``preemptible``: a short prompt's step may run at
        its layer boundaries. A ``preempting`` step is such a short prompt's step: its
        prompts (``job.preempting``) join the regular steps' books once it ran."""
        self.count += 1
        try:
            return await self._run(self.count, planned, computing, preemptible, preempting)
        finally:
            for job, _ in planned:
                job.preempting = False

    async def _run(self, step: int, planned: Planned, computing: Sequence[Job],
                   preemptible: bool, preempting: bool) -> Ended:
        asked = time.perf_counter()  # store grants for the chunks: a wait on the store
        parts = list(await asyncio.gather(*(self._part(job, n) for job, n in planned)))
        granted = time.perf_counter() - asked
        if self.store_writes is not None and not preempting:  # the next step's grants
            self.store_writes.ask_ahead(computing, self.budget, planned, self.align)
        chunks = [PrefillChunk(j.task.token_ids, j.done, j.done + n, j.plan.block_table,
                               j.task.sampling.adapter) for j, n in planned]
        io = StepIO(parts, self.engine.kv, 0, self.mover, self.threads.store,
                    self.rt.config.kv_layerwise)
        for job, n in planned:
            timeline.mark("step", job.task.request_id, n)
        started = time.perf_counter()
        try:
            if preempting:
                hidden, rows = await self.preempt.submit(
                    lambda: self._compute(planned, chunks, io, io.after))
                paused = 0.0
            else:
                self.preemptible = preemptible
                try:
                    hidden, rows, paused = await asyncio.get_running_loop().run_in_executor(
                        self.threads.compute, self._preemptible, planned, chunks, io)
                finally:
                    self.preemptible = False
        except EngineInputError as exc:
            fail_step(self.rt, planned, exc)
            return []
        step_s = time.perf_counter() - started - paused
        await check_loads(parts)
        total = sum(n for _, n in planned)
        for (job, n), part in zip(planned, parts):
            job.compute_s += step_s * n / total
            job.wait_s += granted
            job.put_futures += part.put_futures
            if part.poisoned and job.failed is None:
                job.failed = job.loads.failed if job.loads else "load failed"
        if self.store_writes is not None:
            self.store_writes.step_done(step, parts)
        if self.group is not None:
            await self._ship(step, planned, parts, hidden)
        ended: Ended = []
        for (job, n), row in zip(planned, rows):
            job.done += n
            job.opened = True
            if job.remaining == 0 and not job.aborted and job.failed is None:
                timeline.mark("computed", job.task.request_id)
                ended.append((job, row))
        return ended

    def _preemptible(self, planned: Planned, chunks: list[PrefillChunk], io: StepIO,
                     ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]], float]:
        """A regular step's forward: a waiting preempting step runs after any of its
        layers; also the seconds those took (not this step's own)."""
        paused = 0.0

        def after(layer: int) -> None:
            nonlocal paused
            io.after(layer)
            paused += self.preempt.at_boundary()
        return *self._compute(planned, chunks, io, after), paused

    def _compute(self, planned: Planned, chunks: list[PrefillChunk], io: StepIO,
                 after: Callable[[int], None],
                 ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        """The step's forward (on the compute thread), and the prompt logprobs of the
        chunks of jobs that ask for them (``common/engine/prompt_logprobs.py``; a single
        worker holds every layer, so ``hidden`` is the last layer's)."""
        hidden, rows = self.engine.stage_step(chunks, None, after, io.before)
        offset = 0
        for (job, n), chunk in zip(planned, chunks):
            if job.prompt_logprobs is not None:
                job.prompt_parts.append(chunk_logprobs(
                    self.engine.model, hidden[offset:offset + n], chunk, job.prompt_logprobs))
            offset += n
        return hidden, rows

    async def _part(self, job: Job, n: int) -> PartIO:
        """A job's chunk in the next step: its loads (first chunk) and store puts."""
        start, end = job.done, job.done + n
        part = PartIO(job.stream, start, end, hold_puts=job.sampled if n == job.remaining else None)
        if not job.opened and job.loads is not None:
            part.loads, bs = job.loads, self.block_size
            part.load_tokens = (job.plan.load_from * bs, job.plan.cached_blocks * bs)
        if self.store_writes is not None and job.failed is None:
            await self.store_writes.grant_part(job, part)
        return part

    async def _ship(self, step: int, planned: Planned, parts: list[PartIO],
                    hidden: torch.Tensor) -> None:
        """Hand the step to the next stage; a pipeline that cannot take it ends the group
        (its stages would disagree on what was computed)."""
        assert self.group is not None
        stage_parts = [self.group.part(job.task, job.plan, job.done, job.done + n, job.opened,
                                       part) for (job, n), part in zip(planned, parts)]
        waited = await self.group.ship(step, hidden, stage_parts)
        for job, _ in planned:
            job.wait_s += waited
