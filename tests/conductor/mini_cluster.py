"""A whole cluster in one process, for fencing tests: the real Conductor, PrefillWorker and
DecodeWorker objects, the real block pools and paged KV memories, messages delivered in
order by a pump, and KV bytes really copied from the prefill's memory into the decode
worker's (memmove at the addresses the protocol carries). The engine computes nothing,
but its KV is checkable: prefill writes each token's id into its KV slot (every layer, K
and V), and decode reads the whole context back from its blocks and derives the next
token from it, so KV landed in the wrong blocks changes the output."""
from __future__ import annotations

import asyncio
import ctypes
import time
from typing import Any, Callable, Optional, Sequence

import torch

from common.config import ClusterConfig, SLOConfig
from common.engine.config import DecodeInput, PrefillChunk
from common.kv.events import KVEvents
from common.protocol import (
    RegisterWorker, SubmitRequest, TokenDelta, TokenDeltas, WorkerHeartbeat,
)
from common.protocol import WorkerLoad
from services.conductor.service import Conductor
from services.decode.service import DecodeWorker
from services.prefill.prefix import PrefixLoader
from services.prefill.service import PrefillWorker
from tests.worker_fakes import (
    CONDUCTOR, VOCAB, FakeEngine, FakeMail, FakeRuntime, fake_keys, one_hot, sampling,
)


class KVEngine(FakeEngine):
    """A FakeEngine whose KV content is the token ids (see the module doc). ``reads``:
    (block table, context read back) of every decode of every sequence."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.reads: list[tuple[tuple[int, ...], list[int]]] = []

    def _put(self, blocks: Sequence[int], pos: int, layer: int, token: int) -> None:
        bs = self.config.block_size
        self.kv.data[blocks[pos // bs], layer, :, pos % bs] = float(token)

    def _context(self, blocks: Sequence[int], upto: int) -> list[int]:
        """Token ids read back from the KV of positions [0, upto]; -1 where the layers
        or K and V disagree (a slot written by two writers)."""
        bs, out = self.config.block_size, []
        for pos in range(upto + 1):
            slot = self.kv.data[blocks[pos // bs], :, :, pos % bs].flatten()
            out.append(int(slot[0]) if bool((slot == slot[0]).all()) else -1)
        return out

    def compute_layer(self, chunks: Sequence[PrefillChunk], layer: int) -> None:
        for c in chunks:
            for pos in range(c.start, c.end):
                self._put(c.block_table, pos, layer, c.token_ids[pos])

    def decode_logits(self, decodes: Sequence[DecodeInput]) -> torch.Tensor:
        """Each sequence's next token: its KV written, its whole context read back."""
        tokens = []
        for d in decodes:
            for layer in range(self.model_config.num_layers):
                self._put(d.block_table, d.position, layer, d.token_id)
            context = self._context(d.block_table, d.position)
            self.reads.append((tuple(d.block_table), context))
            tokens.append(sum((i + 1) * t for i, t in enumerate(context)) % (VOCAB - 1) + 1)
        return one_hot(tokens)


class MemTransfer:
    """The transfer agent's write, in one process: memmove to the remote address."""

    session_id = "in-process"

    def write(self, target: str, local: Sequence[int], remote: Sequence[int],
              lengths: Sequence[int]) -> int:
        for src, dst, n in zip(local, remote, lengths):
            ctypes.memmove(dst, src, n)
        return sum(lengths)

    def in_flight(self, target: Optional[str] = None) -> list:
        return []


def runtime(role: str, name: str, epoch: int, num_blocks: int) -> FakeRuntime:
    rt = FakeRuntime(role, KVEngine(num_blocks), ClusterConfig(token_budget=16),
                     instance_id=name, epoch=epoch)
    rt.transfer = MemTransfer()  # type: ignore[assignment]
    return rt


def registration(rt: FakeRuntime) -> RegisterWorker:
    kv = rt.engine.kv
    return RegisterWorker(rt.instance_id, rt.role, f"tcp://{rt.instance_id}", "in-process",
                          kv.base_address, kv.block_nbytes, kv.layer_nbytes, kv.num_blocks,
                          kv.block_size, epoch=rt.epoch)


class MiniCluster:
    """One conductor, one decode worker (``decode_blocks`` KV blocks), prefill workers
    added with ``start_prefill``. ``pump`` delivers every message sent so far, in order;
    ``run_until`` also runs the workers' loops."""

    def __init__(self, decode_blocks: int) -> None:
        self.mail = FakeMail([])
        cfg = ClusterConfig(scheduler="kvcache_centric", slo=SLOConfig(ttft_s=1e3, tbt_s=1e3))
        self.conductor = Conductor(cfg, self.mail)  # type: ignore[arg-type]
        self.inboxes: dict[str, dict[type, Callable[[Any], Any]]] = {
            CONDUCTOR: self.conductor.handlers}
        self.outboxes: list[list[tuple[str, Any]]] = [self.mail.sent]
        self._read = [0]
        self.router: list[Any] = []
        self.loops: list[Callable[[], Any]] = []
        self.drt = runtime("decode", "decode-0", 20, decode_blocks)
        self.decode = DecodeWorker(self.drt)  # type: ignore[arg-type]
        self._join(self.drt, self.decode, self.decode.step_loop)
        self.prefills: list[PrefillWorker] = []

    def _join(self, rt: FakeRuntime, worker: Any, loop: Callable[[], Any]) -> None:
        rt.conductor = CONDUCTOR
        self.inboxes[f"tcp://{rt.instance_id}"] = worker.handlers
        self.outboxes.append(rt.mail.sent)
        self._read.append(0)
        self.loops.append(loop)
        self.conductor.on_register(registration(rt))
        self.conductor.on_heartbeat(WorkerHeartbeat(
            instance_id=rt.instance_id, role=rt.role, load=WorkerLoad(),
            free_blocks=rt.engine.pool.num_free, used_blocks=0,
            total_blocks=rt.engine.pool.num_blocks, events=KVEvents(), event_seq=0, epoch=rt.epoch))

    def start_prefill(self, name: str, epoch: int) -> PrefillWorker:
        """A prefill worker incarnation; one of the same name replaces the last at its
        inbox (the old object lives on, reachable only by what a test hands it)."""
        rt = runtime("prefill", name, epoch, 16)
        worker = PrefillWorker(rt, PrefixLoader(rt.engine.pool, rt.engine.kv, None))  # type: ignore[arg-type]
        self._join(rt, worker, worker.serve)
        self.prefills.append(worker)
        return worker

    def submit(self, rid: str, tokens: list[int], max_tokens: int = 4) -> None:
        self.conductor.on_submit(SubmitRequest(rid, tokens, fake_keys(tokens),
                                               sampling(max_tokens), time.time()))

    def sent(self, kind: type, to: Optional[str] = None) -> list[Any]:
        """Every message of ``kind`` sent by anyone (to ``to``), in order per sender."""
        return [m for box in self.outboxes for a, m in box
                if isinstance(m, kind) and to in (None, a)]

    async def deliver(self, address: str, msg: Any) -> None:
        if address == self.conductor.router_inbox:  # a decode step's deltas, one by one
            self.router.extend(msg.deltas if isinstance(msg, TokenDeltas) else [msg])
            return
        handler = self.inboxes[address].get(type(msg))
        if handler is not None:
            out = handler(msg)
            if asyncio.iscoroutine(out):
                await out

    async def pump(self) -> bool:
        moved = False
        for i, box in enumerate(self.outboxes):
            while self._read[i] < len(box):
                address, msg = box[self._read[i]]
                self._read[i] += 1
                moved = True
                await self.deliver(address, msg)
        return moved

    async def run_until(self, done: Callable[[], bool], timeout_s: float = 10.0) -> None:
        tasks = [asyncio.ensure_future(loop()) for loop in self.loops]
        try:
            deadline = time.monotonic() + timeout_s
            while not done():
                for t in tasks:
                    if t.done():
                        t.result()
                assert time.monotonic() < deadline, "the cluster did not get there"
                if not await self.pump():
                    await asyncio.sleep(0.002)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def output(self, rid: str) -> Optional[list[int]]:
        """The tokens streamed for ``rid`` once it finished; None before."""
        deltas = [m for m in self.router if isinstance(m, TokenDelta) and m.request_id == rid]
        if not deltas or deltas[-1].finish_reason is None:
            return None
        return [t for d in deltas for t in d.token_ids]
