"""The colocated worker: one engine that prefills and decodes in the same steps.

The in-project baseline for disaggregation, and the right deployment for one small box.
It is a decode worker (reservations, continuous batching, streaming, aborts and the
sweep are inherited) that also takes the PrefillTasks the conductor addresses to it and
runs Sarathi-style steps: each step feeds one token of every running sequence it serves
(at most ``max_batch_size``, taking turns beyond that) and fills the rest of a token
budget with chunks of waiting prompts, oldest first, in one forward pass. A prompt's
cached prefix (local cache, then the store) is reused; no KV moves between processes.

Per request: ReserveBlocks → BlocksReserved (as a decode worker) → PrefillTask → the
reservation's leading blocks are swapped for the cached prefix → chunks → the last chunk
samples the first token → PrefillDone to the conductor, and the sequence joins the batch.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Optional

from common.config import ClusterConfig
from common.engine import DecodeInput
from common.engine.batching import plan_chunks
from common.engine.config import PrefillChunk
from common.engine.errors import EngineInputError
from common.grammar import GrammarError
from common.engine.sampling import sample_first
from common.protocol import AbortRequest, PrefillDone, PrefillTask, RequestFailed, WorkerLoad
from common.security import clamp_deadline
from common.worker import WorkerRuntime, fail_step
from services.decode.sequence import Reservation
from services.decode.service import DecodeWorker, serve_worker
from services.decode.turns import Turns
from services.prefill.job import JobState, PromptJob
from services.prefill.prefix import PrefixLoader, PrefixPlan
from services.prefill.prefix_plan import put_back

log = logging.getLogger("colocated")


@dataclass(eq=False, kw_only=True)
class Prefilling(PromptJob):
    """A prompt being computed into its own reservation, chunk by chunk."""

    task: PrefillTask
    reservation: Reservation  # blocks: the cached prefix, then the reserved rest
    keys: list[bytes]
    cached_tokens: int
    global_tokens: int  # of the cached, loaded from the store for this request
    stored_from: int  # first block index not known to be in the store
    started: Optional[float] = None  # perf_counter of its first step (prefill time)


class ColocatedWorker(DecodeWorker):
    def __init__(self, rt: WorkerRuntime, prefix: PrefixLoader) -> None:
        super().__init__(rt)
        self.prefix = prefix
        self.prefilling: list[Prefilling] = []  # arrival order
        self.budget = rt.config.step_budget(rt.role)
        self.align = rt.config.chunk_align()  # batch invariance: where chunks end
        self._admitting: set[asyncio.Task] = set()
        self.handlers[PrefillTask] = self.on_task

    # ------------------------------------------------------------ prompts
    def on_task(self, task: PrefillTask) -> None:
        r = self.reserved.get(task.request_id)
        if task.prefill_epoch != self.rt.epoch or r is None or r.fence != task.fence:
            # for an older incarnation, or aborted or expired meanwhile (the conductor
            # has been told), or for an older reservation of the request
            return self.drop("PrefillTask", task.request_id, f"fence {task.fence}")
        try:
            self.engine.validate_prompt(task.token_ids)
            keys = task.keys(self.engine.config.block_size)
        except (EngineInputError, ValueError) as exc:  # ValueError: keys that do not fit
            del self.reserved[task.request_id]
            self._release(r, "invalid")
            status, kind = ((400, "invalid_request_error") if isinstance(exc, EngineInputError)
                            else (500, "internal_error"))
            self.rt.mail.send(self.rt.conductor, RequestFailed(
                task.request_id, status, kind, str(exc), fence=r.fence))
            return
        deadline = clamp_deadline(task.deadline, self.rt.config.kv_wait_timeout_s)
        job = asyncio.create_task(self._admit(replace(task, deadline=deadline), keys))
        self._admitting.add(job)
        job.add_done_callback(self._admitting.discard)

    async def _admit(self, task: PrefillTask, keys: list[bytes]) -> None:
        """Find the cached prefix (the store lookup awaits), then queue the prompt."""
        tokens = task.token_ids
        cached, from_store, in_store = await self.prefix.lookup(tokens, keys)
        r = self.reserved.pop(task.request_id, None)
        if r is None:  # aborted or expired during the lookup
            self.pool.free(cached)
            return
        k = len(cached)
        self.pool.free(r.blocks[:k])
        r.blocks = cached + r.blocks[k:]
        bs = self.engine.config.block_size
        self.prefilling.append(Prefilling(
            task=task, reservation=r, keys=keys, prompt_len=len(tokens), done=k * bs,
            cached_tokens=k * bs, global_tokens=from_store * bs, stored_from=in_store))
        self.wake.set()

    def _quarantine(self, r: Reservation) -> None:
        """Nothing else writes into a colocated reservation: free it at once."""
        self._release(r, "abort")

    def on_abort(self, msg: AbortRequest) -> None:
        for p in self.prefilling:
            if p.task.request_id == msg.request_id and msg.fence in (None, p.reservation.fence):
                p.aborted = True  # freed between steps, never under a running step
        super().on_abort(msg)

    def _drop_aborted(self) -> None:
        now = time.time()
        keep: list[Prefilling] = []
        for p in self.prefilling:
            if p.aborted:
                self._release(p.reservation, "abort")
            elif now > p.task.deadline:
                self._release(p.reservation, "timeout")
                self.rt.mail.send(self.rt.conductor, RequestFailed(
                    p.task.request_id, 504, "timeout", "prefill missed its deadline",
                    fence=p.reservation.fence))
            else:
                keep.append(p)
        self.prefilling = keep
        for seq in [s for s in self.running.values() if s.aborted]:
            self.finish(seq, "abort")

    def _prefilled(self, p: Prefilling, logits) -> None:  # noqa: ANN001 (a logits row)
        """The prompt's last chunk ran: publish its blocks, report, start decoding."""
        p.move(JobState.ENDING)
        r, task = p.reservation, p.task
        full = len(p.keys)
        self.pool.cache_full_blocks(r.blocks[:full], p.keys)
        if put_back(p.stored_from, full, self.prefix.store is not None):
            # The put reads the blocks after this returns: hold a reference of its own.
            held = self.pool.match_prefix(p.keys)
            self.prefix.release(PrefixPlan(held, 0, 0, p.stored_from), p.keys[:len(held)])
        try:
            first = sample_first(logits, r.params, self.grammars)
        except GrammarError as exc:
            return self.failed(r, 400, "invalid_request_error", str(exc))
        prompt = len(task.token_ids)
        self.rt.mail.send(self.rt.conductor, PrefillDone(
            task.request_id, self.rt.instance_id, prompt, p.cached_tokens, p.global_tokens,
            time.perf_counter() - (p.started or time.perf_counter()), 0, 0.0, r.fence))
        self.start(r, first, prompt, p.cached_tokens)

    # ------------------------------------------------------------ steps
    async def step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        max_batch = self.engine.config.max_batch_size
        turns = Turns()
        while True:
            self._drop_aborted()
            if not self.running and not self.prefilling:
                self.wake.clear()
                await self.wake.wait()
                continue
            batch = [self.running[rid] for rid in turns.next_batch(self.running, max_batch)]
            planned = plan_chunks(self.prefilling, self.budget - len(batch), align=self.align)
            for p, _ in planned:
                p.started = p.started or time.perf_counter()
            chunks = [PrefillChunk(p.task.token_ids, p.done, p.done + n, p.reservation.blocks,
                                   p.task.sampling.adapter) for p, n in planned]
            inputs = [DecodeInput(s.last_token, s.position, s.blocks, s.params.adapter)
                      for s in batch]
            step = loop.run_in_executor(self.compute, lambda: self.engine.step(chunks, inputs))
            bitmask = self.grammars.bitmask([s.matcher for s in batch])  # while it runs
            try:
                per_chunk, logits = await step
            except EngineInputError as exc:
                fail_step(self.rt, planned, exc)
                continue
            if logits is not None:
                self.advance(batch, logits, bitmask)
            for (p, n), row in zip(planned, per_chunk):
                p.done += n
                if row is not None and not p.aborted:
                    self.prefilling.remove(p)
                    self._prefilled(p, row)
            await asyncio.sleep(0)  # let the inbox in between steps

    def idle(self) -> bool:
        return (super().idle() and not self.prefilling and not self._admitting
                and not self.prefix.busy)

    def load(self) -> WorkerLoad:
        queued = len(self.reserved) + len(self.prefilling)
        tokens = sum(p.remaining for p in self.prefilling)
        context = sum(s.context_tokens for s in self.running.values())
        return WorkerLoad(queued=queued, queued_tokens=tokens, running=len(self.running),
                          context_tokens=context)


async def run(config: ClusterConfig, index: int = 0) -> None:
    rt = WorkerRuntime(config, "colocated", index)
    prefix = await PrefixLoader.create(rt)
    worker = ColocatedWorker(rt, prefix)
    log.info("%s ready (inbox %s, %d KV blocks, budget %d tokens/step, store %s)",
             rt.instance_id, rt.inbox_address, rt.engine.kv.num_blocks, worker.budget,
             "on" if prefix.store else "off")
    try:
        await serve_worker(rt, worker)
    finally:
        await prefix.close()
        rt.close()
