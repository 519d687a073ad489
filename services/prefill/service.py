"""The prefill worker: reuses cached prefixes (local pool, then the global KV pool),
computes the rest in chunks, streams each layer's KV into the decode worker's blocks,
samples the first token and hands the request over."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from common.config import ClusterConfig
from common.engine.errors import EngineInputError
from common.engine.sampling import sample
from common.kv.shm_kv import host_id
from common.mailbox import serve_inbox
from common.protocol import (
    AbortRequest, KVFailed, KVReady, PrefillDone, PrefillTask, RequestFailed,
)
from common.transfer import TransferError
from common.worker import WorkerRuntime, make_generator, sampling_params_from_dict
from services.prefill.prefix import PrefixLoader
from services.prefill.streaming import KVPaths, KVStream, RequestAborted

log = logging.getLogger("prefill")


class PrefillFailure(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


class PrefillWorker:
    def __init__(self, rt: WorkerRuntime, prefix: PrefixLoader) -> None:
        self.rt = rt
        self.engine = rt.engine
        self.pool = rt.engine.pool
        self.prefix = prefix
        self.queue: asyncio.Queue[PrefillTask] = asyncio.Queue()
        self.queued_tokens = 0
        self.aborted: set[str] = set()
        self.current: Optional[KVStream] = None
        self.current_id: Optional[str] = None
        self.compute = ThreadPoolExecutor(1, thread_name_prefix="prefill")
        self.stream_thread = ThreadPoolExecutor(1, thread_name_prefix="kv-stream")
        self.kv_paths = KVPaths(rt.config.kv_path, self.engine.kv, host_id())
        self.handlers: dict[type, Callable[[Any], None]] = {
            PrefillTask: self.on_task,
            AbortRequest: self.on_abort,
        }

    def on_task(self, task: PrefillTask) -> None:
        self.queue.put_nowait(task)
        self.queued_tokens += len(task.token_ids)

    def on_abort(self, msg: AbortRequest) -> None:
        self.aborted.add(msg.request_id)
        if self.current is not None and self.current_id == msg.request_id:
            self.current.aborted = True

    def load(self) -> tuple[int, int, int, int]:
        return self.queue.qsize(), self.queued_tokens, 0, 0

    async def serve(self) -> None:
        while True:
            task = await self.queue.get()
            self.queued_tokens -= len(task.token_ids)
            try:
                await self.handle(task)
            except PrefillFailure as exc:
                self.fail(task, exc.status, exc.kind, str(exc))
            except Exception as exc:  # a bug in one request must not stop the worker
                log.exception("prefill of %s failed", task.request_id)
                self.fail(task, 500, "internal_error", f"prefill failed: {exc}")
            finally:
                self.aborted.discard(task.request_id)

    def fail(self, task: PrefillTask, status: int, kind: str, message: str) -> None:
        self.rt.mail.send(task.decode_inbox, KVFailed(task.request_id, kind))
        if kind != "aborted":
            self.rt.mail.send(self.rt.conductor, RequestFailed(task.request_id, status, kind,
                                                               message))

    async def handle(self, task: PrefillTask) -> None:
        if task.request_id in self.aborted:
            raise PrefillFailure(499, "aborted", "aborted before prefill")
        if time.time() > task.deadline:
            raise PrefillFailure(504, "timeout", "deadline passed while queued")
        tokens = task.token_ids
        try:
            self.engine.validate_prompt(tokens)
        except EngineInputError as exc:
            raise PrefillFailure(400, "invalid_request_error", str(exc)) from exc
        start = time.perf_counter()
        keys = self.engine.block_keys(tokens)
        plan = await self.prefix.acquire(tokens, keys)
        if plan is None:
            raise PrefillFailure(503, "prefill_kv_full", "prefill KV memory is full")
        try:
            first, logprob, stream = await self._compute_and_stream(task, plan.block_table,
                                                                    plan.cached_blocks)
        except BaseException:
            self.pool.free(plan.block_table)
            raise
        elapsed = time.perf_counter() - start
        bs = self.engine.config.block_size
        cached_tokens = plan.cached_blocks * bs
        self.rt.mail.send(task.decode_inbox, KVReady(task.request_id, first, logprob,
                                                     len(tokens), cached_tokens))
        self.rt.mail.send(self.rt.conductor, PrefillDone(
            task.request_id, self.rt.instance_id, len(tokens), cached_tokens,
            plan.global_blocks * bs, elapsed, stream.bytes, stream.seconds))
        self.prefix.release(plan, keys)

    async def _compute_and_stream(self, task: PrefillTask, table: list[int],
                                  cached_blocks: int) -> tuple[int, Optional[float], KVStream]:
        rt = self.rt
        stream = self.kv_paths.open(rt.transfer, self.stream_thread, self.engine.kv, table,
                                    task)
        self.current, self.current_id = stream, task.request_id
        stream.send_whole_blocks(cached_blocks)
        num_cached = cached_blocks * self.engine.config.block_size
        loop = asyncio.get_running_loop()
        try:
            logits = await loop.run_in_executor(
                self.compute, lambda: self.engine.prefill(task.token_ids, table, num_cached,
                                                          layer_hook=stream.on_layer))
            await stream.wait(max(1.0, task.deadline - time.time()))
            self.kv_paths.done(stream)
        except RequestAborted as exc:
            stream.cancel()
            raise PrefillFailure(499, "aborted", "aborted during prefill") from exc
        except TransferError as exc:
            stream.cancel()
            raise PrefillFailure(503, "kv_transfer_failed", str(exc)) from exc
        finally:
            self.current, self.current_id = None, None
        params = sampling_params_from_dict(task.sampling)
        tokens, logprobs = sample(logits.unsqueeze(0), [params],
                                  [make_generator(params, 0)])
        return int(tokens[0]), logprobs[0], stream


async def run(config: ClusterConfig, index: int = 0) -> None:
    rt = WorkerRuntime(config, "prefill", index)
    prefix = await PrefixLoader.create(rt)
    worker = PrefillWorker(rt, prefix)
    tasks = [asyncio.create_task(c) for c in (worker.serve(), rt.heartbeat_loop(worker.load))]
    log.info("%s ready (inbox %s, %d KV blocks, store %s)", rt.instance_id, rt.inbox_address,
             rt.engine.kv.num_blocks, "on" if prefix.store else "off")
    try:
        await serve_inbox(rt.mail, worker.handlers, tasks)
    finally:
        await prefix.close()
        rt.close()
