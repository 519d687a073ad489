"""A later stage of a prefill group: compute each step for this stage's layers.

Steps come from the previous stage in order (``StageStep``: the parts, and the hidden
states in one of our slots). For each, this stage reads the hidden states and frees the
slot, opens the KV stream of every request starting here, computes its layers (loading
store blocks and streaming KV and store writes per layer, services/prefill/layer_io.py),
then hands its hidden states on, or, as the last stage, samples the first token of every
prompt that ends. When a request's last chunk is done here and none of its writes can
land any more, it reports to the head (``StageReport``); a step's store writes are
reported per step (``StageStored``). The block ids are the head's: its pool owns them.

A follower belongs to one head incarnation: when that head's beats stop or another head
beats, it exits (its writes stop with it) and the supervisor starts it again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Optional

import torch

from common.config import ClusterConfig
from common.engine.config import PrefillChunk
from common.grammar import GrammarError
from common.engine.sampling import Grammars, sample_first
from common.host import host_id
from services.prefill.hidden import HiddenInbox
from common.mailbox import serve_inbox
from common.recent import Recent
from common.protocol import Fence
from services.prefill.stage_protocol import (
    StageAbort, StageAck, StageBeat, StageHello, StagePart, StageReport, StageStep, StageStored,
)
from common.store.ranges import RangeMover
from common.worker import WorkerRuntime
from services.prefill.group import NextStage, StageLost
from services.prefill.job import JobState, StageJob
from services.prefill.lanes import PrefillThreads
from services.prefill.layer_io import PartIO, StepIO, check_loads, settle, start_loads
from services.prefill.streaming import KVPaths

log = logging.getLogger("prefill.stage")

SLOTS = 2  # hidden-state slots: the previous stage computes step s+1 while we read s
ABORTED_MEMORY = 4096  # requests aborted here: a late chunk of one is never streamed

Key = tuple[str, Fence]


class StageWorker:
    def __init__(self, rt: WorkerRuntime, index: int) -> None:
        cfg = rt.config
        place = cfg.prefill_place(index)
        self.stage, self.stages = place.stage, place.stages
        self.rt = rt
        self.engine = rt.engine
        self.kv = rt.engine.kv
        self.first_layer = rt.engine.layers.start
        self.last = self.stage == self.stages - 1
        self.head = cfg.inbox("prefill", place.head)
        self.prev = cfg.inbox("prefill", index - 1)
        hidden = rt.engine.model_config.hidden_size
        self.hidden_in = HiddenInbox(rt.transfer, rt.instance_id, SLOTS,
                                     cfg.step_budget("prefill") * hidden * 4)
        self.next = None if self.last else NextStage(rt.mail, rt.transfer, cfg.kv_path,
                                                     cfg.inbox("prefill", index + 1))
        self.kv_paths = KVPaths(cfg.kv_path, self.kv, host_id(), first_layer=self.first_layer,
                                total_layers=rt.engine.model_config.num_layers)
        self.threads = PrefillThreads()  # compute, store lanes, decode peers
        self.mover = (RangeMover(rt.transfer, cfg.store.shm_dir,
                                 device_memory=self.kv.device_bytes)
                      if cfg.store.enabled else None)
        self.grammars = Grammars.for_engine(rt.engine)  # the last stage's first tokens
        self.timeout_s = cfg.heartbeat_timeout_s
        self.head_epoch: Optional[int] = None  # the head we follow
        self.last_beat = time.monotonic()
        self.lost: Optional[StageLost] = None
        self.steps: dict[int, StageStep] = {}
        self.next_step = 1
        self.wake = asyncio.Event()
        self.jobs: dict[Key, StageJob] = {}
        self.current: set[Key] = set()  # in the step computing now
        self.aborted: Recent[Key] = Recent(ABORTED_MEMORY)
        self.tasks: set[asyncio.Task] = set()
        self.handlers = {StageStep: self.on_step, StageAbort: self.on_abort,
                         StageBeat: self.on_beat}
        if self.next is not None:
            self.handlers.update({StageHello: self.next.on_hello, StageAck: self.next.on_ack})

    # ------------------------------------------------------------ the head
    def on_beat(self, msg: StageBeat) -> None:
        if self.head_epoch is None:
            self.head_epoch = msg.head_epoch
            log.info("%s follows head %s (epoch %d)", self.rt.instance_id, self.head,
                     msg.head_epoch)
        elif msg.head_epoch != self.head_epoch:
            self.lost = StageLost(f"another head incarnation beats ({msg.head_epoch})")
        self.last_beat = time.monotonic()

    def kv_bytes(self) -> dict[str, int]:
        """Bytes this stage moved so far, by flow/path (``KVPaths.moved``)."""
        return self.kv_paths.moved(self.mover, self.next.sent if self.next else None)

    async def hello_loop(self) -> None:
        """Say hello to the head and the previous stage every interval; exit (the group
        restarts) once our head is gone."""
        while True:
            hello = StageHello(self.stage, self.rt.epoch, self.rt.inbox_address,
                               self.hidden_in.route, self.head_epoch or 0, self.kv_bytes())
            for inbox in {self.head, self.prev}:
                self.rt.mail.send(inbox, hello)
            silent = time.monotonic() - self.last_beat
            if self.head_epoch is not None and silent > self.timeout_s / 2 and not self.lost:
                self.lost = StageLost(f"no beat from the head for {silent:.1f}s")
            if self.lost is not None:
                log.error("%s: %s: exiting", self.rt.instance_id, self.lost)
                raise self.lost
            await asyncio.sleep(self.rt.config.heartbeat_interval_s)

    # ------------------------------------------------------------ steps
    def on_step(self, msg: StageStep) -> None:
        if self.head_epoch is None or msg.head_epoch != self.head_epoch:
            self.rt.dropped["epoch"] += 1
            return
        for part in msg.parts:  # the first tokens' grammars compile while the step runs
            if self.last and part.sampling is not None:
                self.grammars.prefetch(part.sampling)
        self.steps[msg.step] = msg
        self.wake.set()

    async def serve(self) -> None:
        while True:
            msg = self.steps.pop(self.next_step, None)
            if msg is None:
                self.wake.clear()
                await self.wake.wait()
                continue
            self.next_step += 1
            await self.step(msg)

    async def step(self, msg: StageStep) -> None:
        hidden = self.hidden_in.read(msg.slot, msg.tokens,
                                     self.engine.model_config.hidden_size,
                                     getattr(torch, msg.dtype))
        self.rt.mail.send(self.prev, StageAck(msg.head_epoch, msg.step, msg.slot))
        ios = [self._part(p) for p in msg.parts]
        keys = [(p.request_id, p.fence) for p in msg.parts]
        chunks = [PrefillChunk(self._zeros(k, p), p.start, p.end, p.block_table, p.adapter)
                  for k, p in zip(keys, msg.parts)]
        io = StepIO(ios, self.kv, self.first_layer, self.mover, self.threads.store,
                    self.rt.config.kv_layerwise)
        self.current = set(keys)
        started = time.perf_counter()
        try:
            hidden, rows = await asyncio.get_running_loop().run_in_executor(
                self.threads.compute,
                lambda: self.engine.stage_step(chunks, hidden, io.after, io.before))
        finally:
            self.current = set()
        step_s = time.perf_counter() - started
        await check_loads(ios)
        total = sum(p.end - p.start for p in msg.parts)
        for key, part, pio in zip(keys, msg.parts, ios):
            job = self.jobs.get(key)
            if job is None:
                continue
            job.compute_s += step_s * (part.end - part.start) / total
            job.put_futures += pio.put_futures
            if pio.poisoned and not job.failed:
                job.failed = job.loads.failed if job.loads and job.loads.failed else (
                    "computed from a failed load on an earlier stage")
        self._report_stored(msg, ios)
        if self.next is not None:
            parts = [replace(p, poisoned=p.poisoned or pio.poisoned)
                     for p, pio in zip(msg.parts, ios)]
            waited = await self.next.ship(msg.head_epoch, msg.step, hidden, parts,
                                          2 * self.timeout_s)
            for key in keys:
                if key in self.jobs:
                    self.jobs[key].wait_s += waited
        for key, part, row in zip(keys, msg.parts, rows):
            job = self.jobs.get(key)
            if job is None:
                continue
            if row is not None and part.sampling is not None and not job.failed:
                await self.grammars.ready(part.sampling)
                try:
                    job.first = sample_first(row, part.sampling, self.grammars)
                except GrammarError as exc:  # the head fails it with a 400
                    job.failed, job.invalid = str(exc), True
            if (job.aborted or part.end == part.prompt_len) and job.state is not JobState.ENDING:
                self._spawn(self.finish(key, job, part.deadline))

    def _part(self, part: StagePart) -> PartIO:
        key = (part.request_id, part.fence)
        if part.opening is not None and key not in self.aborted and key not in self.jobs:
            self._open(key, part)
        job = self.jobs.get(key)
        if job is None:  # aborted here, or never opened: compute, write nothing
            return PartIO(None, part.start, part.end, poisoned=True)  # type: ignore[arg-type]
        pio = PartIO(job.stream, part.start, part.end,
                     poisoned=part.poisoned or bool(job.failed) or job.aborted)
        if part.opening is not None and job.loads is not None:
            bs = self.engine.config.block_size
            pio.loads = job.loads
            pio.load_tokens = (part.opening.load_from * bs, part.opening.cached_blocks * bs)
        if part.put is not None:
            pio.put = part.put
            pio.put_local = [part.block_table[b] for b in part.put_blocks]
        return pio

    def _open(self, key: Key, part: StagePart) -> None:
        opening = part.opening
        assert opening is not None
        target = opening.target
        try:
            lane = self.threads.peers.get(target.decode_id)
            stream = self.kv_paths.open(self.rt.transfer, lane, self.kv, part.block_table, target)
        except ValueError as exc:
            log.warning("%s: cannot stream %s: %s", self.rt.instance_id, part.request_id, exc)
            return
        loads = None
        if opening.load is not None and self.mover is not None:
            loads = start_loads(self.mover, opening.load, self.kv,
                                part.block_table[opening.load_from:opening.cached_blocks],
                                self.first_layer, self.threads.load)
        stream.send_prefix(opening.load_from if loads is not None else opening.cached_blocks,
                           opening.cached_blocks)
        self.jobs[key] = StageJob(prompt_len=part.prompt_len, stream=stream, loads=loads,
                                  zeros=[0] * part.prompt_len)

    def _zeros(self, key: Key, part: StagePart) -> list[int]:
        job = self.jobs.get(key)
        return job.zeros if job is not None else [0] * part.prompt_len

    def _report_stored(self, msg: StageStep, ios: list[PartIO]) -> None:
        with_put = [pio for pio in ios if pio.put is not None]
        if not with_put:
            return

        async def report() -> None:
            await settle([f for pio in with_put for f in pio.put_futures])
            written = [w for pio in with_put for w in pio.written()]
            self.rt.mail.send(self.head, StageStored(msg.head_epoch, self.stage, msg.step,
                                                     written))
        self._spawn(report())

    # ------------------------------------------------------------ endings
    async def finish(self, key: Key, job: StageJob, deadline: float) -> None:
        """The request's last chunk ran here (or it was aborted): report once none of its
        writes can land any more. It stays in ``jobs`` until then: an abort meanwhile marks
        it."""
        job.move(JobState.ENDING)
        started = time.perf_counter()
        error = job.failed or ""
        if not error and not job.aborted:
            try:
                if not self.rt.config.kv_layerwise:
                    job.stream.send_rest()
                await job.stream.wait(max(1.0, deadline - time.time()))
            except Exception as exc:  # TransferError: the stream failed or timed out
                error = str(exc)
        error = error or ("aborted" if job.aborted else "")
        if error:
            await job.stream.settle()
        await settle(job.put_futures)
        if job.loads is not None:
            await job.loads.settle()
        if not error:
            self.kv_paths.done(job.stream)
        job.wait_s += time.perf_counter() - started + (job.loads.wait_s if job.loads else 0)
        self.jobs.pop(key, None)
        self._report(key, ok=not error, error=error, kv_bytes=job.stream.bytes,
                     compute_s=job.compute_s, wait_s=job.wait_s,
                     first=job.first if self.last else [], invalid=job.invalid)

    def on_abort(self, msg: StageAbort) -> None:
        if msg.head_epoch != self.head_epoch:
            return
        key = (msg.request_id, msg.fence)
        self.aborted.add(key)
        job = self.jobs.get(key)
        if job is None:  # nothing of it here (never came, or reported already)
            return self._report(key, ok=False, error="aborted")
        job.aborted = True
        job.stream.cancel()
        if key not in self.current and job.state is not JobState.ENDING:  # else that one reports
            self._spawn(self.finish(key, job, 0.0))

    def _report(self, key: Key, ok: bool, error: str = "", **fields) -> None:
        assert self.head_epoch is not None
        self.rt.mail.send(self.head, StageReport(self.head_epoch, self.stage, key[0], key[1],
                                                 ok, error, **fields))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        """A bug in an ending is logged; the head, missing this stage's report, fails the
        request at its deadline and restarts the group."""
        self.tasks.discard(task)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            log.error("%s: a request's ending failed", self.rt.instance_id, exc_info=exc)

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.threads.close()
        self.kv_paths.close()
        if self.next is not None:
            self.next.close()
        if self.mover is not None:
            self.mover.close()
        self.hidden_in.close()


async def run_follower(config: ClusterConfig, index: int) -> None:
    rt = WorkerRuntime(config, "prefill", index)
    worker = StageWorker(rt, index)
    tasks = [asyncio.create_task(c) for c in (worker.serve(), worker.hello_loop())]
    log.info("%s ready: stage %d of %d, layers %d-%d, inbox %s", rt.instance_id, worker.stage,
             worker.stages, rt.engine.layers.start, rt.engine.layers.stop - 1,
             rt.inbox_address)
    try:
        await serve_inbox(rt.mail, worker.handlers, tasks)
    finally:
        worker.close()
        rt.close()
