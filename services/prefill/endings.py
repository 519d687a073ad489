"""How a prefill job ends: handed over (its KV landed on the decode worker, its first
token sampled: ``KVReady`` to the decode worker, ``PrefillDone`` to the conductor) or given
up (only once none of its writes can land any more: then its blocks are freed and
``KVFailed`` lets the decode worker reuse its own). Either way it ends once.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from common import timeline
from common.engine.prompt_logprobs import join
from common.engine.sampling import Grammars, sample_first
from common.grammar import GrammarError
from common.protocol import KVFailed, KVReady, PrefillDone, PrefillTask, RequestFailed
from common.transfer import TransferError
from common.worker import WorkerRuntime
from services.prefill.group import HeadGroup
from services.prefill.job import Job, PrefillFailure
from services.prefill.layer_io import settle
from services.prefill.prefix import PrefixLoader
from services.prefill.streaming import KVPaths


class Endings:
    def __init__(self, rt: WorkerRuntime, prefix: PrefixLoader, kv_paths: KVPaths,
                 group: Optional[HeadGroup], grammars: Grammars) -> None:
        self.rt = rt
        self.prefix = prefix
        self.kv_paths = kv_paths
        self.group = group
        self.grammars = grammars
        self.layerwise = rt.config.kv_layerwise
        self.pool = rt.engine.pool
        self.block_size = rt.engine.config.block_size

    async def give_up(self, job: Job, failure: PrefillFailure) -> None:
        """Stop the stream and wait until none of its writes can land (they read our
        blocks and write the decode worker's), however long, on every stage: only then
        free our blocks and send KVFailed, which lets the decode worker reuse its blocks."""
        outcome = self.group.abort(job.task) if self.group is not None else None
        job.sampled.set()  # its held store writes go (or fail) now
        await job.stream.settle()
        await settle(job.put_futures)
        if job.loads is not None:
            await job.loads.settle()
        if outcome is not None:
            await self.group.settled(outcome)
        self.pool.free(job.plan.block_table)
        self.fail(job.task, failure.status, failure.kind, str(failure))

    async def finish(self, job: Job, logits: Optional[torch.Tensor]) -> None:
        """The prompt's last chunk ran: wait for its KV to land (on every stage), sample
        (or take the last stage's token), hand over."""
        task = job.task
        outcome = self.group.expect(task) if self.group is not None else None
        started = time.perf_counter()
        try:
            if not self.layerwise:  # the baseline: every block after the prefill
                job.stream.send_rest()
            await job.stream.wait(max(1.0, task.deadline - time.time()))
            if outcome is not None:  # its wait for the later stages counts in wait_s
                result = await self.group.result(outcome, task.deadline)
            else:
                await self.grammars.ready(task.sampling)  # prefetched when the task came
            first = (sample_first(logits, task.sampling, self.grammars) if outcome is None
                     else result.first)
        except TransferError as exc:
            return await self.give_up(job, PrefillFailure(503, "kv_transfer_failed", str(exc)))
        except GrammarError as exc:
            return await self.give_up(job, PrefillFailure(400, "invalid_request_error", str(exc)))
        job.sampled.set()
        job.wait_s += time.perf_counter() - started
        if job.aborted:
            return await self.give_up(job, PrefillFailure(499, "aborted", "aborted"))
        self.kv_paths.done(job.stream)
        bs, prompt = self.block_size, len(task.token_ids)
        cached_tokens = job.plan.cached_blocks * bs
        if job.loads is not None:
            job.wait_s += job.loads.wait_s
        timeline.mark("kv_ready", task.request_id)
        self.rt.mail.send(task.decode_inbox, KVReady(
            task.request_id, first, prompt, cached_tokens, task.fence,
            join(job.prompt_parts) if job.prompt_logprobs is not None else None))
        read = ((job.loads.nbytes, job.loads.read_s) if job.loads is not None
                else (job.plan.read_bytes, job.plan.read_s))
        self.rt.mail.send(self.rt.conductor, PrefillDone(
            task.request_id, self.rt.instance_id, prompt, cached_tokens,
            job.plan.global_blocks * bs, job.compute_s,
            job.stream.bytes + (result.kv_bytes if outcome is not None else 0),  # the group's
            job.stream.seconds, task.fence, wait_s=job.wait_s, store_read_bytes=read[0],
            store_read_s=read[1], admit_s=job.admit_s))
        # the new blocks' store writes read our blocks: they settle before the blocks are
        # released, not before the first token (they are for later requests)
        await settle(job.put_futures)
        self.prefix.release(job.plan, job.keys)

    def fail(self, task: PrefillTask, status: int, kind: str, message: str) -> None:
        self.rt.mail.send(task.decode_inbox, KVFailed(task.request_id, kind, task.fence))
        if kind != "aborted":
            self.rt.mail.send(self.rt.conductor, RequestFailed(
                task.request_id, status, kind, message, fence=task.fence))
