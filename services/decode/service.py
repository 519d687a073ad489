"""The decode worker: reserves KV blocks, receives KV over the transfer engine,
runs continuous batching and streams tokens to the router."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from common import timeline
from common.config import ClusterConfig
from common.mailbox import serve_inbox
from common.engine import DecodeInput
from common.grammar import GrammarError, Grammars
from common.engine.sampling import make_generator, sample
from common.idle_check import IdleCheck
from common.kv.demand import kv_demand
from common.security import clamp_deadline
from common.protocol import (
    KV_FAILED, AbortRequest, BlocksReserved, Fence, FenceQuery, KVFailed, KVReady, RequestFailed,
    RequestFinished, ReserveBlocks, ReserveFailed, StepTotals, TokenDelta, WorkerGone,
    WorkerLoad,
)
from common.sampling_params import PromptLogprobs, SampledToken, SamplingParams, TopLogprobs
from common.worker import WorkerRuntime
from common.worker_metrics import current as metrics
from services.decode.detok import IncrementalText
from services.decode.outbox import DeltaOutbox
from services.decode.sequence import Reservation, Running
from services.decode.turns import Turns

log = logging.getLogger("decode")

# The last resort for a quarantined reservation whose writer never answers and is never
# reported gone (a prefill killed and not restarted): its blocks are freed after this
# long. Shorter frees blocks sooner but could hand a block to another request while a
# write still lands; a prefill never starts a write after its task's deadline
# (kv_wait_timeout_s) and every write has its own, so 10 minutes is far past both.
QUARANTINE_S = 600.0
FENCE_QUERY_EVERY_S = 1.0  # a quarantined reservation's writer is asked this often


class DecodeWorker:
    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        self.engine = rt.engine
        self.pool = rt.engine.pool
        self.reserved: dict[str, Reservation] = {}  # live, by request id
        self.quarantine: dict[int, Reservation] = {}  # by generation: a writer may be alive
        self.quarantine_s = QUARANTINE_S
        self.generations = itertools.count(1)
        self.dropped = rt.dropped  # stale messages, by kind: reported in heartbeats
        self.running: dict[tuple[str, int], Running] = {}  # by (request id, choice)
        self.choices: dict[str, int] = {}  # request id → its choices still running
        self.wake = asyncio.Event()
        self._compiling: set[asyncio.Task] = set()  # KVReady waiting for its grammar
        self.idle_check = IdleCheck(self.pool.check_idle, "KV block pool")
        self.compute = ThreadPoolExecutor(1, thread_name_prefix="decode")
        self.grammars = Grammars.for_engine(self.engine)
        self.steps = StepTotals()  # the step loop's, for the conductor's decode refit
        self.outbox = DeltaOutbox(rt.mail)  # tokens to the routers, a message a step
        rt.decode_steps = lambda: self.steps
        self.handlers: dict[type, Callable[[Any], None]] = {
            **rt.handlers,  # ReRegister
            ReserveBlocks: self.on_reserve,
            KVReady: self.on_kv_ready,
            KVFailed: self.on_kv_failed,
            AbortRequest: self.on_abort,
            WorkerGone: self.on_worker_gone,
        }

    # ------------------------------------------------------------ reservations
    def on_reserve(self, msg: ReserveBlocks) -> None:
        if msg.epoch != self.rt.epoch:
            return self.drop("ReserveBlocks", msg.request_id, f"for epoch {msg.epoch}")
        if msg.request_id in self.reserved or msg.request_id in self.choices:
            return
        need = kv_demand(msg.prompt_tokens, msg.sampling.new_tokens, msg.sampling.n,
                         self.engine.config.block_size,
                         self.engine.model_config.max_position_embeddings)
        blocks = self.pool.try_allocate(need.blocks)
        if blocks is None:
            self.rt.mail.send(self.rt.conductor, ReserveFailed(
                msg.request_id, self.rt.instance_id,
                f"needs {need.blocks} blocks, {self.pool.num_free} free", msg.attempt))
            return
        blocks, rest = blocks[:need.own], blocks[need.own:]
        self.grammars.prefetch(msg.sampling)  # compiled while its prefill runs
        fence = Fence(self.rt.epoch, next(self.generations))
        self.reserved[msg.request_id] = Reservation(
            msg.request_id, blocks, msg.prompt_tokens, msg.sampling, msg.router_inbox,
            deadline=clamp_deadline(msg.deadline, self.rt.config.kv_wait_timeout_s),
            fence=fence, writer=msg.writer, writer_epoch=msg.writer_epoch,
            writer_inbox=msg.writer_inbox,
            tails=[rest[i * need.tail:(i + 1) * need.tail] for i in range(need.n - 1)])
        self.rt.mail.send(self.rt.conductor, BlocksReserved(msg.request_id, self.rt.instance_id,
                                                            blocks, fence, msg.attempt))

    def drop(self, kind: str, request_id: str, why: str) -> None:
        """A message no live state of this incarnation matches: logged, counted, ignored."""
        self.dropped[kind] += 1
        log.info("%s: dropped stale %s for %s (%s)", self.rt.instance_id, kind, request_id, why)

    def _settled(self, kind: str, request_id: str, fence: Fence) -> Optional[Reservation]:
        """The live reservation ``fence`` names (popped), or None: a quarantined one it
        names is freed (its writer confirmed it stopped), anything else is stale."""
        r = self.reserved.get(request_id)
        if r is not None and r.fence == fence:
            return self.reserved.pop(request_id)
        q = self.quarantine.pop(fence.generation, None) if fence.epoch == self.rt.epoch else None
        if q is not None and q.request_id == request_id:
            self._release(q, "abort")
        else:
            if q is not None:
                self.quarantine[fence.generation] = q
            self.drop(kind, request_id, f"fence {fence} is not live")
        return None

    def on_kv_ready(self, msg: KVReady) -> None:
        timeline.mark("decode_in", msg.request_id)
        waiting = self.reserved.get(msg.request_id)
        if (waiting is not None and waiting.fence == msg.fence
                and not self.grammars.is_ready(waiting.params)):
            # its grammar still compiles: it starts once compiled, the loop free meanwhile
            # (an abort or expiry in between leaves this KVReady stale, as any other)
            task = asyncio.create_task(self._when_compiled(waiting.params, msg))
            self._compiling.add(task)
            task.add_done_callback(self._compiling.discard)
            return
        r = self._settled("KVReady", msg.request_id, msg.fence)
        if r is not None:
            self.start(r, msg.first, msg.prompt_tokens, msg.cached_tokens,
                       msg.prompt_logprobs)

    async def _when_compiled(self, params: SamplingParams, msg: KVReady) -> None:
        await self.grammars.ready(params)
        self.on_kv_ready(msg)

    def start(self, r: Reservation, first: list[SampledToken], prompt_tokens: int,
              cached_tokens: int, prompt_logprobs: Optional[PromptLogprobs] = None) -> None:
        """The prompt's KV is in ``r.blocks``: each choice joins the batch with its first
        token, in blocks of its own past the prompt's full ones (``_fork``). Choice 0's
        first delta carries the prompt's logprobs, where asked."""
        if r.params.max_tokens == 0:
            return self._prompt_only(r, prompt_tokens, cached_tokens, prompt_logprobs)
        choices = [r.params.choice(i) for i in range(r.params.n)]
        if len(first) != len(choices):
            log.error("%s: %s: %d first tokens for n=%d", self.rt.instance_id, r.request_id,
                      len(first), len(choices))
            return self.failed(r, 500, "internal_error", "first tokens do not match n")
        try:
            matchers = [self.grammars.matcher(p) for p in choices]
        except GrammarError as exc:
            return self.failed(r, 400, "invalid_request_error", str(exc))
        self.choices[r.request_id] = len(choices)
        timeline.mark("first_sent", r.request_id)  # in record_token below
        for i, (params, blocks, matcher, sampled) in enumerate(
                zip(choices, self._fork(r, prompt_tokens), matchers, first)):
            resumed = len(params.resumed)  # a continuation's: generated already
            seq = Running(
                request_id=r.request_id, blocks=blocks, position=prompt_tokens,
                last_token=sampled.token, params=params, router_inbox=r.router_inbox,
                prompt_tokens=prompt_tokens - resumed,
                cached_tokens=min(cached_tokens, prompt_tokens - resumed),
                text=IncrementalText.resuming(self.engine.decode_tokens, params.stop,
                                              params.resumed, params.resumed_chars),
                generator=make_generator(params, 1), fence=r.fence, matcher=matcher,
                index=i, generated=resumed)
            self.running[seq.key] = seq
            self.record_token(seq, sampled.token, sampled.logprob, sampled.top,
                              prompt_logprobs if i == 0 else None)
        self.wake.set()

    def _prompt_only(self, r: Reservation, prompt_tokens: int, cached_tokens: int,
                     prompt_logprobs: Optional[PromptLogprobs]) -> None:
        """``max_tokens`` 0 (``echo``: the prompt's logprobs only): every choice ends at
        once, with no token; the request leaves."""
        self.pool.free(r.owned)
        for i in range(r.params.n):
            self.outbox.put(r.router_inbox, TokenDelta(
                request_id=r.request_id, token_ids=[], text="", logprobs=None,
                finish_reason="length", prompt_tokens=prompt_tokens, completion_tokens=0,
                cached_tokens=cached_tokens, index=i,
                prompt_logprobs=prompt_logprobs if i == 0 else None))
        self.rt.mail.send(self.rt.conductor, RequestFinished(
            r.request_id, self.rt.instance_id, "length", r.fence))

    def _fork(self, r: Reservation, prompt_tokens: int) -> list[list[int]]:
        """The block tables of the request's choices: choice 0 runs in ``r.blocks``; each
        other one shares the prompt's full blocks (one more reference each) and gets a
        copy of the last, partial one in its own first block: every choice writes its
        next token there, so it cannot be shared (copy on write, done at once)."""
        shared = prompt_tokens // self.engine.config.block_size
        tables = [r.blocks]
        for tail in r.tails:
            self.pool.share(r.blocks[:shared])
            tables.append(r.blocks[:shared] + tail)
        if r.tails and prompt_tokens % self.engine.config.block_size:
            self.engine.kv.copy_blocks([r.blocks[shared]] * len(r.tails),
                                       [tail[0] for tail in r.tails])
        return tables

    def failed(self, r: Reservation, status: int, kind: str, why: str) -> None:
        """``r`` cannot start (its grammar cannot be compiled here: a 400): its KV has
        landed and nothing writes any more, so free its blocks and fail it alone."""
        self.pool.free(r.owned)
        self.rt.mail.send(self.rt.conductor, RequestFailed(
            r.request_id, status, kind, why, fence=r.fence))

    def on_kv_failed(self, msg: KVFailed) -> None:
        r = self._settled("KVFailed", msg.request_id, msg.fence)
        if r is not None:
            self._release(r, KV_FAILED)

    def on_abort(self, msg: AbortRequest) -> None:
        r = self.reserved.get(msg.request_id)
        if r is not None and msg.fence in (None, r.fence):
            self._quarantine(self.reserved.pop(msg.request_id))
        if msg.request_id in self.choices:
            for seq in self.running.values():
                if seq.request_id == msg.request_id and msg.fence in (None, seq.fence):
                    seq.aborted = True

    def _quarantine(self, r: Reservation) -> None:
        """A prefill worker may still write into these blocks: keep them out of the pool
        until it confirms for this fence (KVReady/KVFailed), the conductor reports its
        incarnation gone (WorkerGone), or the last-resort quarantine ends."""
        r.release_at = time.time() + self.quarantine_s
        self.quarantine[r.fence.generation] = r

    def on_worker_gone(self, msg: WorkerGone) -> None:
        for q in [q for q in self.quarantine.values() if q.writer == msg.instance_id
                  and q.writer_epoch != msg.live_epoch]:
            del self.quarantine[q.fence.generation]
            self._release(q, "abort")

    def sweep(self) -> None:
        """Fail reservations whose KV never came (their blocks go to quarantine), ask the
        writers of quarantined ones whether a write may still land (FenceQuery, every
        second until answered), and free them at their last-resort time."""
        now = time.time()
        for q in self.quarantine.values():
            if q.writer_inbox is not None and now >= q.next_query:
                q.next_query = now + FENCE_QUERY_EVERY_S
                self.rt.mail.send(q.writer_inbox, FenceQuery(q.request_id, q.fence,
                                                             self.rt.inbox_address))
        for r in [r for r in self.reserved.values() if now > r.deadline]:
            del self.reserved[r.request_id]
            self._quarantine(r)
            self.rt.mail.send(self.rt.conductor, RequestFailed(
                r.request_id, 504, "timeout", "KV cache did not arrive in time",
                fence=r.fence))
        for q in [q for q in self.quarantine.values() if now > (q.release_at or 0.0)]:
            del self.quarantine[q.fence.generation]
            self.dropped["quarantine_expired"] += 1
            log.error("%s: %s's blocks freed after %.0fs of quarantine without a word from "
                      "%s", self.rt.instance_id, q.request_id, self.quarantine_s, q.writer)
            self._release(q, "abort")

    def _release(self, r: Reservation, reason: str) -> None:
        self.pool.free(r.owned)
        self.rt.mail.send(self.rt.conductor, RequestFinished(
            r.request_id, self.rt.instance_id, reason, r.fence))

    # ------------------------------------------------------------ generation
    def record_token(self, seq: Running, token: int, logprob: Optional[float],
                     top: Optional[TopLogprobs] = None,
                     prompt_logprobs: Optional[PromptLogprobs] = None) -> None:
        """Record one sampled token, stream it, and finish the sequence if it must stop."""
        p = seq.params
        seq.generated += 1
        grammar_ended = seq.matcher is not None and self._grammar_ends(seq, token)
        finish: Optional[str] = None
        delta = ""
        ids = [token]
        if token in p.stop_token_ids or (
                not p.ignore_eos and token in self.engine.model_config.eos_token_ids):
            finish, ids = "stop", []
        else:
            delta, hit = seq.text.add(token)
            if logprob is not None and p.logprobs:
                seq.logprobs.append(logprob)
            if hit or grammar_ended:
                finish = "stop"
            elif seq.generated >= p.max_tokens or \
                    seq.position + 1 >= self.engine.model_config.max_position_embeddings:
                finish = "length"
        if finish is not None:
            delta += seq.text.finish()  # "" after a stop string: the text ends before it
        seq.last_token = token
        self.outbox.put(seq.router_inbox, TokenDelta(
            request_id=seq.request_id, token_ids=ids, text=delta,
            logprobs=[logprob] if (p.logprobs and logprob is not None and ids) else None,
            finish_reason=finish, prompt_tokens=seq.prompt_tokens,
            completion_tokens=seq.generated, cached_tokens=seq.cached_tokens,
            top_logprobs=[top] if (top is not None and ids) else [], index=seq.index,
            prompt_logprobs=prompt_logprobs))
        if finish is not None:
            self.finish(seq, finish)

    def _grammar_ends(self, seq: Running, token: int) -> bool:
        """Advance the sequence's grammar with ``token``: True once the grammar is
        complete (its matcher terminated), or if it refuses the token, which the mask
        rules out (the first token came from a prefill worker that used the same one)."""
        if not seq.matcher.accept_token(token):
            log.error("%s: %s: token %d breaks its response_format grammar; stopping",
                      self.rt.instance_id, seq.request_id, token)
            return True
        return seq.matcher.is_terminated()

    def finish(self, seq: Running, reason: str) -> None:
        """A choice ends: its blocks are freed (the shared ones lose its reference); the
        request leaves with its last choice."""
        if self.running.pop(seq.key, None) is None:
            return
        self.pool.free(seq.blocks)
        left = self.choices[seq.request_id] - 1
        if left:
            self.choices[seq.request_id] = left
            return
        del self.choices[seq.request_id]
        self.rt.mail.send(self.rt.conductor, RequestFinished(
            seq.request_id, self.rt.instance_id, reason, seq.fence))

    async def step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        max_batch = self.engine.config.max_batch_size
        turns = Turns()  # beyond max_batch sequences take turns (services/decode/turns.py)
        while True:
            for seq in [s for s in self.running.values() if s.aborted]:
                self.finish(seq, "abort")
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            started = time.perf_counter()
            batch = [self.running[rid] for rid in turns.next_batch(self.running, max_batch)]
            inputs = [DecodeInput(s.last_token, s.position, s.blocks, s.params.adapter)
                      for s in batch]
            context = sum(s.context_tokens for s in batch)
            step = loop.run_in_executor(self.compute, self.engine.decode_step, inputs)
            bitmask = self.grammars.bitmask([s.matcher for s in batch])  # while it runs
            self.advance(batch, await step, bitmask)
            await asyncio.sleep(0)  # let the inbox in between steps
            self.steps = self.steps.add(len(batch), context, time.perf_counter() - started)

    def advance(self, batch: list[Running], logits: torch.Tensor,
                bitmask: Optional[torch.Tensor]) -> None:
        """Sample one token for each sequence of a step (among those its grammar allows:
        ``bitmask``, filled while the step computed) and stream it."""
        sampled = sample(logits, [s.params for s in batch], [s.generator for s in batch],
                         bitmask, [s.text.ids for s in batch])
        for seq, (tok, lp, top) in zip(batch, sampled):
            if seq.aborted:
                self.finish(seq, "abort")
                continue
            seq.position += 1
            self.record_token(seq, tok, lp, top)

    def idle(self) -> bool:
        """Nothing reserved, quarantined or running: every block of the pool is free."""
        return not self.reserved and not self.running and not self.quarantine

    def load(self) -> WorkerLoad:
        context = sum(s.context_tokens for s in self.running.values())
        metrics().quarantined_blocks.set(sum(len(q.owned) for q in self.quarantine.values()))
        return WorkerLoad(queued=len(self.reserved), running=len(self.running),
                          context_tokens=context, quarantined=len(self.quarantine))


async def serve_worker(rt: WorkerRuntime, worker: DecodeWorker) -> None:
    """Run a decode worker (or a colocated one) until cancelled: its steps, heartbeats,
    the sweep of reservations whose KV never came, and the inbox."""
    async def sweeper() -> None:
        while True:
            await asyncio.sleep(0.5)
            worker.sweep()

    tasks = [asyncio.create_task(c) for c in
             (worker.step_loop(), rt.heartbeat_loop(worker.load, worker.idle), sweeper(),
              worker.idle_check.watch(worker.idle))]
    await serve_inbox(rt.mail, worker.handlers, tasks)


async def run(config: ClusterConfig, index: int = 0) -> None:
    rt = WorkerRuntime(config, "decode", index)
    worker = DecodeWorker(rt)
    log.info("%s ready (inbox %s, %d KV blocks)", rt.instance_id, rt.inbox_address,
             rt.engine.kv.num_blocks)
    try:
        await serve_worker(rt, worker)
    finally:
        rt.close()
