"""The prefill worker: reuses cached prefixes (local pool, then the global KV pool),
computes the rest in chunks, streams each layer's KV into the decode worker's blocks,
samples the first token and hands the request over.

Several prompts are computed together: each step is one forward pass over chunks of the
admitted prompts, shortest first (queue.py), up to ``token_budget`` tokens (``Engine.step``).
A prompt is admitted (its blocks referenced, its cached prefix streamed) while those before
it leave room in the next step. A short prompt (``prefill_preempt_tokens``) arriving while a
step computes does not wait for it: its own step runs at that step's next layer boundary
(preempt.py). Each chunk's KV streams to its decode worker layer by layer as the next
computes; how a prompt ends (handed over, or given up) is services/prefill/endings.py.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, Callable, Coroutine, Optional

from common import timeline
from common.config import ClusterConfig
from common.engine.batching import plan_chunks
from common.engine.sampling import Grammars
from common.host import host_id
from common.idle_check import IdleCheck
from common.mailbox import serve_inbox
from common.recent import Recent
from common.protocol import (
    AbortRequest, Fence, FenceQuery, KVFailed, PrefetchLoads, PrefillTask, WorkerLoad)
from common.scheduling.prefill_order import PromptOrder
from common.security import clamp_deadline
from services.prefill.stage_protocol import StageStored
from common.worker import WorkerRuntime, fail_step
from services.prefill.endings import Endings
from services.prefill.group import HeadGroup
from services.prefill.lanes import PrefillThreads
from services.prefill.layer_io import start_loads
from services.prefill.job import Job, JobState, PrefillFailure, checked_keys
from services.prefill.prefix import PrefixLoader
from services.prefill.queue import PromptQueue
from services.prefill.steps import PrefillSteps
from services.prefill.store_writes import StoreWrites
from services.prefill.streaming import KVPaths

log = logging.getLogger("prefill")

# Fences of the latest tasks taken (a replayed one never writes into blocks its reservation
# may have given up): a minute of tasks (their deadline) at ~70 per second
SERVED_MEMORY = 4096


class PrefillWorker:
    def __init__(self, rt: WorkerRuntime, prefix: PrefixLoader, index: int = 0) -> None:
        self.rt, self.engine, self.pool, self.prefix = rt, rt.engine, rt.engine.pool, prefix
        self.budget, self.align = rt.config.step_budget(rt.role), rt.config.chunk_align()
        self.block_size = self.engine.config.block_size
        self.waiting = PromptQueue(self.pool, self.block_size, order=PromptOrder.of(rt.config))
        self.max_waiting = rt.config.max_queue  # the conductor admits no more cluster-wide
        self.jobs: list[Job] = []  # admitted and not yet reported, oldest first (job.py)
        self.admission = asyncio.Lock()  # one admission at a time (regular or preempting)
        self.admitting: Optional[PrefillTask] = None  # out of ``waiting``, not a job yet
        self.admitting_aborted = False  # ... and aborted meanwhile
        self.dropped = rt.dropped  # stale messages, by kind: reported in heartbeats
        self.served: Recent[Fence] = Recent(SERVED_MEMORY)  # the latest tasks taken
        self.wake = asyncio.Event()
        self.idle_check = IdleCheck(self.pool.check_idle, "KV block pool")
        self.grammars = Grammars.for_engine(self.engine)  # response_format: first tokens
        self.threads = PrefillThreads()  # compute, store lanes, decode peers
        self.kv_paths = KVPaths(rt.config.kv_path, self.engine.kv, host_id(),
                                total_layers=self.engine.model_config.num_layers)
        self._settling: set[asyncio.Task] = set()  # jobs' recompute, finish or give_up
        self.mover = prefix.store.mover if prefix.store is not None else None
        rt.kv_bytes = lambda: (self.group.moved(self.kv_paths, self.mover) if self.group
                               else self.kv_paths.moved(self.mover))
        stages = rt.config.prefill_place(index).stages
        self.group = HeadGroup(rt, index) if stages > 1 else None
        self.store_writes = (StoreWrites(prefix.store, stages - 1, self.block_size,
                                         prefix.object_nbytes)
                             if prefix.store is not None and rt.config.kv_layerwise else None)
        self.endings = Endings(rt, prefix, self.kv_paths, self.group, self.grammars)
        self.steps = PrefillSteps(rt, self.threads, self.mover, self.store_writes, self.group,
                                  self.budget, self.align)
        self.preempt_tokens = rt.config.prefill_preempt_tokens if (
            self.group is None and self.engine.profiler.directory is None) else 0
        self.backlog_s = rt.config.prefill_preempt_backlog_s
        self._preempting: Optional[asyncio.Task] = None
        self.handlers: dict[type, Callable[[Any], None]] = {
            **rt.handlers,  # ReRegister
            PrefillTask: self.on_task,
            PrefetchLoads: self.prefix.prefetch,  # the store's answer comes before its task
            AbortRequest: self.on_abort,
            FenceQuery: self.on_fence_query,
        }
        if self.group is not None:
            self.handlers.update(self.group.handlers)
        if self.store_writes is not None:
            self.handlers[StageStored] = self.store_writes.on_stored

    # ------------------------------------------------------------ inbox
    def on_task(self, task: PrefillTask) -> None:
        timeline.mark("prefill_in", task.request_id)
        if task.prefill_epoch != self.rt.epoch:  # for an older incarnation of this worker
            return self._drop("epoch", task)
        if task.fence in self.served or self._live(task.request_id):
            return self._drop("duplicate", task)  # a replay, or an older attempt running
        if self.group is not None and not self.group.followers.ready:
            return self.endings.fail(task, 503, "prefill_stage_down",
                                     f"a pipeline stage of {self.rt.instance_id} is not up")
        if len(self.waiting) >= self.max_waiting:
            return self.endings.fail(task, 503, "prefill_queue_full", f"{self.max_waiting} "
                                     f"prompts are queued on {self.rt.instance_id}")
        self.served.add(task.fence)  # a replay of it must never write again
        self.grammars.prefetch(task.sampling)  # compiled while it waits and computes
        # a sender-chosen deadline reaches no further than this worker's own limit
        self.waiting.append(replace(task, deadline=clamp_deadline(
            task.deadline, self.rt.config.kv_wait_timeout_s)))
        self.wake.set()
        if self.steps.preemptible and self.preempt_tokens and self._preempting is None:
            self._preempting = asyncio.create_task(self.preempting())

    def on_fence_query(self, q: FenceQuery) -> None:
        """May a write under ``q.fence`` still land? A task admitting, computing or
        settling under it answers when its writes settle. Otherwise none can: a task queued
        under it is dropped, and the fence is remembered so a late task under it is too."""
        if any(j.task.fence == q.fence for j in self.jobs) or (
                self.admitting is not None and self.admitting.fence == q.fence):
            return
        self.waiting.drop(lambda t: t.fence == q.fence)
        self.served.add(q.fence)
        self.rt.mail.send(q.decode_inbox, KVFailed(q.request_id, "released", q.fence))

    def _live(self, request_id: str) -> bool:
        """An attempt of ``request_id`` is queued or running here, not aborted (a re-run,
        here too after a decode worker's loss, queues while the aborted old one settles)."""
        return any(t.request_id == request_id for t in self.waiting) or any(
            j.task.request_id == request_id and j.live for j in self.jobs) or (
            self.admitting is not None and self.admitting.request_id == request_id
            and not self.admitting_aborted)

    def _drop(self, why: str, task: PrefillTask) -> None:
        self.dropped[why] += 1
        log.info("%s: dropped %s PrefillTask %s (fence %s)", self.rt.instance_id, why,
                 task.request_id, task.fence)

    def on_abort(self, msg: AbortRequest) -> None:
        """Abort the attempt ``msg.fence`` names (every attempt without a fence)."""
        def named(rid: str, fence: Fence) -> bool:
            return rid == msg.request_id and msg.fence in (None, fence)

        for job in self.jobs:
            if job.state is not JobState.ENDING and named(job.task.request_id, job.task.fence):
                job.aborted = job.stream.aborted = True  # dropped between steps
        if self.admitting is not None and named(self.admitting.request_id, self.admitting.fence):
            self.admitting_aborted = True
        for task in self.waiting.drop(lambda t: named(t.request_id, t.fence)):
            self.endings.fail(task, 499, "aborted", "aborted before prefill")  # none written

    def idle(self) -> bool:
        """Nothing queued, computing, ending (in ``jobs`` until settled) or being put."""
        return not (self.waiting or self.jobs or self.prefix.busy)

    def load(self) -> WorkerLoad:
        computing = [j for j in self.jobs if j.state is JobState.COMPUTING]
        tokens = sum(len(t.token_ids) for t in self.waiting) + sum(j.remaining for j in computing)
        return WorkerLoad(queued=len(self.waiting) + len(computing), queued_tokens=tokens)

    @property
    def computing(self) -> list[Job]:
        """The computing prompts in the order their chunks take a step's budget (a
        preempting one is computed in a step of its own)."""
        return self.waiting.sort(j for j in self.jobs
                                 if j.state is JobState.COMPUTING and not j.preempting)

    # ------------------------------------------------------------ admission
    async def admit(self) -> None:
        """Admit waiting prompts in order while each has room in the next step."""
        async with self.admission:
            while (first := self.waiting.next(self.jobs)) is not None and (
                    ahead := self.waiting.tokens_before(self.computing, first[1])) < self.budget:
                if await self._admit(first[0], self.budget - ahead) is None:
                    return

    async def _admit(self, task: PrefillTask, left: int) -> Optional[Job | bool]:
        """Admit ``task`` (from ``waiting.next``), ``left``: the tokens its first chunk may
        take of its step. Its job; False: it failed or was aborted (reported); None: KV
        memory is full until a running prompt finishes (it waits again)."""
        arrived = self.waiting.take(task)
        self.admitting, self.admitting_aborted = task, False
        try:
            job = await self._start(task, arrived, left)
        except PrefillFailure as exc:
            self.endings.fail(task, exc.status, exc.kind, str(exc))
            return False
        finally:
            self.admitting = None
            self.waiting.release(task)  # its plan referenced its prefix, or needs none
        if job is not None:
            self.waiting.resume()
            job.aborted = job.stream.aborted = self.admitting_aborted
            self.jobs.append(job)
            return job
        if self.admitting_aborted:
            self.endings.fail(task, 499, "aborted", "aborted before prefill")
            return False
        self.waiting.append(task, arrived)
        return None

    async def preempting(self) -> None:
        """While a step computes, the short prompts that arrive have steps of their own
        inside it (preempt.py), one after another, each over the waiting prompts of at
        most ``preempt_tokens`` to compute together, shortest first."""
        try:
            while self.steps.preemptible and (planned := await self._admit_short()):
                await self.step(planned)
        except Exception as exc:  # a bug: its prompts fail, the worker serves on
            stuck = [(job, 0) for job in self.jobs if job.preempting]
            for job, _ in stuck:
                job.preempting = False
            fail_step(self.rt, stuck, exc)
        finally:
            self._preempting = None
            self.wake.set()  # prompts it left queued or failed: the regular loop's

    async def _admit_short(self) -> list[tuple[Job, int]]:
        """Admit the waiting prompts a preempting step computes whole: those ready, in
        order, within ``preempt_tokens`` together. One that turns out to load its prefix
        from the store (its step would wait on the reads) computes in the regular steps."""
        planned: list[tuple[Job, int]] = []
        room = self.preempt_tokens
        async with self.admission:
            while self.steps.preemptible and (first := self.waiting.next(self.jobs, most=room)):
                job = await self._admit(first[0], room)
                if job is None:
                    break
                if job and not (job.aborted or job.loads is not None
                                or job.prompt_logprobs is not None
                                or job.remaining > room):
                    job.preempting = True
                    planned.append((job, job.remaining))
                    room -= job.remaining
        return planned

    async def _start(self, task: PrefillTask, arrived: float, left: int) -> Optional[Job]:
        """Admit ``task``; ``left``: the tokens its first chunk may take of the next step."""
        started = time.perf_counter()
        timeline.mark("admitting", task.request_id)
        keys = checked_keys(task, self.engine, self.block_size, self.group is not None)
        tokens = task.token_ids
        whole = task.sampling.prompt_logprobs is not None  # every row's logits: no prefix
        plan = await self.prefix.acquire(tokens, keys, from_store=task.store_loads,
                                         reuse_prefix=not whole, request_id=task.request_id)
        if plan is None:
            if self.jobs or self.waiting.release_all():  # ending jobs free blocks; holds do
                return None
            raise PrefillFailure(503, "prefill_kv_full", "prefill KV memory is full")
        try:
            lane = self.threads.peers.get(task.decode_id)
            stream = self.kv_paths.open(self.rt.transfer, lane, self.engine.kv,
                                        plan.block_table, task.target)
        except ValueError as exc:  # the decode side reserved too few blocks
            self.pool.free(plan.block_table)
            raise PrefillFailure(500, "internal_error", str(exc)) from exc
        done = min(plan.cached_blocks * self.block_size, len(tokens) - 1)
        if self.store_writes is not None:  # the first chunk's grant, during what follows
            self.store_writes.ask_first(task.fence, keys, plan.stored_from, done, len(tokens), left)
        loads = (start_loads(self.mover, plan.load, self.engine.kv,  # reads start now
                             plan.block_table[plan.load_from:plan.cached_blocks], 0,
                             self.threads.load) if plan.load is not None and self.mover else None)
        # whole blocks present already; loaded ones follow as they land (layer_io)
        stream.send_prefix(plan.load_from if loads is not None else plan.cached_blocks,
                           plan.cached_blocks)
        timeline.mark("admitted", task.request_id, done)
        return Job(task=task, keys=keys, plan=plan, stream=stream, prompt_len=len(tokens),
                   done=done, loads=loads, admit_s=time.perf_counter() - started,
                   arrived=arrived)

    # ------------------------------------------------------------ steps
    async def serve(self) -> None:
        while True:
            await self.admit()
            self._drop_failed()
            if self.computing:
                await self.step()
                continue
            self.wake.clear()
            if self.waiting:  # waiting for KV memory: a finishing prompt frees some
                await asyncio.sleep(0.01)
            else:
                await self.wake.wait()

    async def step(self, planned: Optional[list[tuple[Job, int]]] = None) -> None:
        """One forward over chunks of the admitted prompts (or, ``planned``, a preempting
        step over short ones); hand over those it ends."""
        if planned is None:  # a regular step
            computing = self.computing
            planned = plan_chunks(computing, self.budget, align=self.align)
            ended = await self.steps.run(planned, computing, self._preemptible(planned))
        else:
            ended = await self.steps.run(planned, preempting=True)
        for job, row in ended:
            self._spawn(job, JobState.ENDING, self.endings.finish(job, row))

    def _preemptible(self, planned: list[tuple[Job, int]]) -> bool:
        """Whether short prompts may preempt a step of ``planned``: not a step of an aged
        prompt (short ones would put it off for ever), nor, where set, while a prompt here
        has waited ``prefill_preempt_backlog_s`` (the worker is behind: a short prompt
        joins the next step at no extra step's cost; README, BENCHMARKS.md)."""
        now = time.monotonic()
        if any(self.waiting.order.aged(job.arrived, now) for job, _ in planned):
            return False
        return self.backlog_s is None or not self.waiting.waited(
            now, self.backlog_s, (job for job, _ in planned))

    def _spawn(self, job: Job, state: JobState, coro: Coroutine[Any, Any, None]) -> None:
        """Move ``job`` to ``state`` and run ``coro`` for it (recompute, finish or give
        up): its writes are settling meanwhile, and it answers fence queries for them."""
        job.move(state)
        task = asyncio.create_task(coro)
        self._settling.add(task)
        task.add_done_callback(lambda done: self._ended(job, done))

    def _ended(self, job: Job, task: asyncio.Task) -> None:
        """``job``'s coroutine ended: an ending job leaves the books (it reported)."""
        self._settling.discard(task)
        exc = None if task.cancelled() else task.exception()
        if job.state is JobState.ENDING or exc is not None:
            self.jobs.remove(job)
        if exc is not None:  # a bug: say so, and let nobody wait for this request
            log.error("%s: ending the prefill failed", job.task.request_id, exc_info=exc)
            self.endings.fail(job.task, 500, "internal_error", f"prefill worker error: {exc!r}")

    def _drop_failed(self) -> None:
        """Aborted prompts and prompts past their deadline leave between steps."""
        now = time.time()
        for job in [j for j in self.computing if j.aborted or j.failed or
                    now > j.task.deadline]:
            if self.store_writes is not None:
                self.store_writes.forget(job.task.fence)
            if job.failed and not job.aborted and now <= job.task.deadline and (
                    self.group is None):
                self._spawn(job, JobState.RELOADING, self.recompute(job))
                continue
            if not job.aborted:
                log.warning("%s failed: %s", job.task.request_id, job.failure())
            self._spawn(job, JobState.ENDING, self.endings.give_up(job, job.failure()))

    async def recompute(self, job: Job) -> None:
        """A layer-wise load failed (the store lost the blocks, or the copy outlived its
        lease): compute the prefix instead, as when a whole-block fetch fails, so a cache
        miss costs time, not the request. The failed load's reads may still land in its
        blocks, so they settle first; what was streamed from them is streamed again,
        after, on the same ordered lane. (In a pipeline group the stages would have to
        restart together: there the request fails, ``kv_load_failed``.)"""
        log.warning("%s: %s; computing the prefix instead", job.task.request_id, job.failed)
        if job.loads is not None:
            await job.loads.settle()
        self.dropped["store_load"] += 1  # gave up a load: crescent_worker_dropped
        job.rewind_to_local_prefix(self.block_size)
        job.move(JobState.COMPUTING)  # aborted or late meanwhile: given up between steps
        self.wake.set()


async def run(config: ClusterConfig, index: int = 0) -> None:
    """A prefill worker, or the head of a prefill group (process ``index`` of it is stage
    0); a later stage of a group runs services/prefill/stage.py."""
    if config.prefill_place(index).stage > 0:
        from services.prefill.stage import run_follower
        return await run_follower(config, index)
    rt = WorkerRuntime(config, "prefill", index)
    prefix = await PrefixLoader.create(rt)
    worker = PrefillWorker(rt, prefix, index)
    coros = [worker.serve(), rt.heartbeat_loop(worker.load, worker.idle),
             worker.idle_check.watch(worker.idle)]
    if worker.group is not None:
        rt.available = lambda: worker.group.followers.ready
        coros.append(worker.group.beat_loop())
    tasks = [asyncio.create_task(c) for c in coros]
    log.info("%s ready (inbox %s, %d KV blocks, budget %d tokens/step, store %s)",
             rt.instance_id, rt.inbox_address, rt.engine.kv.num_blocks, worker.budget,
             "on" if prefix.store else "off")
    try:
        await serve_inbox(rt.mail, worker.handlers, tasks)
    finally:
        if worker.store_writes is not None:
            await worker.store_writes.close()
        await prefix.close()
        worker.threads.close()
        if worker.group is not None:
            worker.group.close()
        rt.close()
