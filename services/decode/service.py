"""The decode worker: reserves KV blocks, receives KV over the transfer engine,
runs continuous batching and streams tokens to the router."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from common.config import ClusterConfig
from common.mailbox import serve_inbox
from common.engine import DecodeInput
from common.engine.sampling import sample
from common.idle_check import IdleCheck
from common.protocol import (
    AbortRequest, BlocksReserved, KVFailed, KVReady, RequestFailed, RequestFinished,
    ReserveBlocks, ReserveFailed, TokenDelta, WorkerLoad,
)
from common.worker import WorkerRuntime, make_generator
from services.decode.detok import IncrementalText
from services.decode.sequence import Reservation, Running
from services.decode.turns import Turns

log = logging.getLogger("decode")


class DecodeWorker:
    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        self.engine = rt.engine
        self.pool = rt.engine.pool
        self.reserved: dict[str, Reservation] = {}
        self.running: dict[str, Running] = {}
        self.wake = asyncio.Event()
        self.idle_check = IdleCheck(self.pool.check_idle, "KV block pool")
        self.compute = ThreadPoolExecutor(1, thread_name_prefix="decode")
        self.handlers: dict[type, Callable[[Any], None]] = {
            ReserveBlocks: self.on_reserve,
            KVReady: self.on_kv_ready,
            KVFailed: self.on_kv_failed,
            AbortRequest: self.on_abort,
        }

    # ------------------------------------------------------------ reservations
    def on_reserve(self, msg: ReserveBlocks) -> None:
        limit = self.engine.model_config.max_position_embeddings
        tokens = min(msg.prompt_tokens + msg.sampling.max_tokens, limit)
        n = -(-tokens // self.engine.config.block_size)
        if msg.request_id in self.reserved or msg.request_id in self.running:
            return
        blocks = self.pool.try_allocate(n)
        if blocks is None:
            self.rt.mail.send(self.rt.conductor, ReserveFailed(
                msg.request_id, self.rt.instance_id,
                f"needs {n} blocks, {self.pool.num_free} free"))
            return
        self.reserved[msg.request_id] = Reservation(
            msg.request_id, blocks, msg.prompt_tokens, msg.sampling, msg.router_inbox,
            deadline=msg.deadline)
        self.rt.mail.send(self.rt.conductor, BlocksReserved(msg.request_id, self.rt.instance_id,
                                                            blocks))

    def on_kv_ready(self, msg: KVReady) -> None:
        r = self.reserved.pop(msg.request_id, None)
        if r is None:
            return
        if r.aborted:
            self._release(r.request_id, r.blocks, "abort")
            return
        self.start(r, msg.first_token, msg.first_logprob, msg.prompt_tokens, msg.cached_tokens)

    def start(self, r: Reservation, first_token: int, first_logprob: Optional[float],
              prompt_tokens: int, cached_tokens: int) -> None:
        """The prompt's KV is in ``r.blocks``: join the batch with the first token."""
        seq = Running(
            request_id=r.request_id, blocks=r.blocks, position=prompt_tokens,
            last_token=first_token, params=r.params, router_inbox=r.router_inbox,
            prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
            text=IncrementalText(self.engine.decode_tokens, r.params.stop),
            generator=make_generator(r.params, 1))
        self.running[seq.request_id] = seq
        self.record_token(seq, first_token, first_logprob)
        self.wake.set()

    def on_kv_failed(self, msg: KVFailed) -> None:
        r = self.reserved.pop(msg.request_id, None)
        if r is not None:
            self._release(r.request_id, r.blocks, "kv_failed")

    def on_abort(self, msg: AbortRequest) -> None:
        r = self.reserved.get(msg.request_id)
        if r is not None:
            # The prefill worker may still be writing into these blocks: keep them until it
            # confirms (KVReady/KVFailed) or the deadline passes.
            r.aborted = True
            r.deadline = min(r.deadline, time.time() + 10.0)
        seq = self.running.get(msg.request_id)
        if seq is not None:
            seq.aborted = True

    def sweep(self) -> None:
        """Free reservations whose KV never came."""
        now = time.time()
        for r in [r for r in self.reserved.values() if now > r.deadline]:
            del self.reserved[r.request_id]
            self._release(r.request_id, r.blocks, "abort" if r.aborted else "kv_timeout")
            if not r.aborted:
                self.rt.mail.send(self.rt.conductor, RequestFailed(
                    r.request_id, 504, "timeout", "KV cache did not arrive in time"))

    def _release(self, request_id: str, blocks: list[int], reason: str) -> None:
        self.pool.free(blocks)
        self.rt.mail.send(self.rt.conductor, RequestFinished(request_id, self.rt.instance_id,
                                                             reason))

    # ------------------------------------------------------------ generation
    def record_token(self, seq: Running, token: int, logprob: Optional[float]) -> None:
        """Record one sampled token, stream it, and finish the sequence if it must stop."""
        p = seq.params
        seq.generated += 1
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
            if hit:
                finish = "stop"
            elif seq.generated >= p.max_tokens or \
                    seq.position + 1 >= self.engine.model_config.max_position_embeddings:
                finish = "length"
        if finish is not None:
            delta += seq.text.finish() if finish == "length" else ""
        seq.last_token = token
        self.rt.mail.send(seq.router_inbox, TokenDelta(
            request_id=seq.request_id, token_ids=ids, text=delta,
            logprobs=[logprob] if (p.logprobs and logprob is not None and ids) else None,
            finish_reason=finish, prompt_tokens=seq.prompt_tokens,
            completion_tokens=seq.generated, cached_tokens=seq.cached_tokens))
        if finish is not None:
            self.finish(seq, finish)

    def finish(self, seq: Running, reason: str) -> None:
        if self.running.pop(seq.request_id, None) is not None:
            self._release(seq.request_id, seq.blocks, reason)

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
            batch = [self.running[rid] for rid in turns.next_batch(self.running, max_batch)]
            inputs = [DecodeInput(s.last_token, s.position, s.blocks) for s in batch]
            logits = await loop.run_in_executor(self.compute, self.engine.decode_step, inputs)
            self.advance(batch, logits)
            await asyncio.sleep(0)  # let the inbox in between steps

    def advance(self, batch: list[Running], logits: torch.Tensor) -> None:
        """Sample one token for each sequence of a step and stream it."""
        tokens, logprobs = sample(logits, [s.params for s in batch], [s.generator for s in batch])
        for seq, tok, lp in zip(batch, tokens, logprobs):
            if seq.aborted:
                self.finish(seq, "abort")
                continue
            seq.position += 1
            self.record_token(seq, int(tok), lp)

    def idle(self) -> bool:
        """Nothing reserved or running: every block of the pool is free."""
        return not self.reserved and not self.running

    def load(self) -> WorkerLoad:
        context = sum(s.context_tokens for s in self.running.values())
        return WorkerLoad(queued=len(self.reserved), running=len(self.running),
                          context_tokens=context)


async def serve_worker(rt: WorkerRuntime, worker: DecodeWorker) -> None:
    """Run a decode worker (or a colocated one) until cancelled: its steps, heartbeats,
    the sweep of reservations whose KV never came, and the inbox."""
    async def sweeper() -> None:
        while True:
            await asyncio.sleep(0.5)
            worker.sweep()

    tasks = [asyncio.create_task(c) for c in
             (worker.step_loop(), rt.heartbeat_loop(worker.load), sweeper(),
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
