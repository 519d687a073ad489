"""A stage's KV I/O around each of its layers in one step.

Before layer l reads the KV memory: wait until the blocks loaded from the store have
layer l (``LayerLoads``: one read per layer, all queued at once on the load lane, so layer
l+1 loads while layer l computes; on a GPU ``LaunchedLoads``: every layer's read queued on
the GPU at admission, the compute's stream waiting for each), then stream those blocks'
layer l to the decode worker.
After layer l wrote its tokens' K/V: stream them to the decode worker (``KVStream``) and
write layer l of every store object the chunk completes (``PutPlan``) on the store lane.

The same code serves a lone prefill worker (a group of one) and every stage of a group:
layer indices are the stage's own (its KV memory holds only its layers); the store object
and the decode block hold every layer, so their offsets use ``first_layer + l``.

A failed load poisons its request on this stage: what it computes from then on is
garbage, so it neither streams nor stores any more (the request fails; a store object is
committed only where every stage wrote it, common/store/ranges.py).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from common.kv.memory import PagedKVMemory
from common.store.plans import GetPlan, PutPlan
from common.store.ranges import RangeMover
from common.transfer import watched
from services.prefill.streaming import KVStream, RequestAborted

log = logging.getLogger(__name__)

HOLD_S = 0.5  # a held store write waits at most this for its prompt's first token


class LayerLoads:
    """Blocks of one request read from the store layer by layer into local ``blocks``."""

    def __init__(self, mover: RangeMover, plan: GetPlan, kv: PagedKVMemory,
                 blocks: list[int], first_layer: int, lane: ThreadPoolExecutor) -> None:
        self.plan = plan
        self.mover = mover
        ln = kv.layer_nbytes
        self.nbytes = len(blocks) * ln * kv.num_layers
        self._first: Optional[float] = None  # the first read's start, the last one's end
        self._last: Optional[float] = None

        local = kv.host_bytes() if kv.in_host_memory else None
        at = np.asarray(blocks, dtype=np.int64) * kv.block_nbytes  # each block's layer 0
        by_node: Optional[dict[str, Any]] = None  # the plan's keys: listed by the first read

        def read(layer: int) -> None:  # on the one lane thread: same-host segments in
            # numpy's loops, which leave the GIL to the event loop (a Python loop over a
            # 16k prompt's 921 blocks per layer held it 8-12 ms of its admission)
            nonlocal by_node
            if self._first is None:
                self._first = time.perf_counter()
                by_node = plan.first_replicas() if local is not None else None
            offset = (first_layer + layer) * ln
            if by_node is None or not mover.read_same_host(plan, by_node, local,
                                                           at + layer * ln, offset, ln):
                mover.read(plan, [(i, kv.layer_address(b, layer), offset, ln)
                                  for i, b in enumerate(blocks)])
            self._last = time.perf_counter()

        self.futures: list[Future] = [lane.submit(read, layer)
                                      for layer in range(kv.num_layers)]
        self.failed: Optional[str] = None
        self.wait_s = 0.0

    @property
    def read_s(self) -> float:
        """Seconds from the first read's start to the last one's end (once all landed):
        what the store's bytes took on their path, queueing on the lane left out."""
        if self._first is None or self._last is None:
            return 0.0
        return self._last - self._first

    def wait(self, layer: int) -> bool:
        """In the compute thread: layer ``layer`` has landed (False: a read failed, or
        missed the lease; the rest are cancelled)."""
        if self.failed is None:
            started = time.perf_counter()
            try:
                self.futures[layer].result(timeout=max(0.0, self.plan.deadline - time.time()))
            except Exception as exc:  # TransferError, a timeout, a cancelled read
                self.failed = f"layer-wise load failed at layer {layer}: {exc}"
                for f in self.futures:
                    f.cancel()
            self.wait_s += time.perf_counter() - started
        return self.failed is None

    async def landed(self) -> bool:
        """After the step that used them: every layer landed (``wait`` knew it then)."""
        return self.failed is None

    async def settle(self) -> None:
        """Until none of its reads can land in its blocks any more: those queued and,
        after a failure, any native call of the mover that outlived its deadline."""
        await settle(self.futures)
        if self.failed is not None and self.mover.transfer is not None:
            await settle(self.mover.transfer.in_flight())


class LaunchedLoads:
    """A GPU's blocks read from same-host store segments with every layer queued at once
    on the mover's read stream (``RangeMover.launch_reads``: 2D DMA per layer): the
    compute's stream waits for layer l's event on the GPU, so neither the compute thread
    nor a lane waits per layer, and the reads run under the compute of the layers before.
    Whether every layer landed within the lease is known once the step ran (``landed``):
    a late one poisons the request like a failed ``LayerLoads.wait``."""

    def __init__(self, reads: Any, nbytes: int) -> None:
        self.reads = reads
        self.nbytes = nbytes
        self.failed: Optional[str] = None
        self.wait_s = 0.0  # the compute thread never waits
        self.read_s = 0.0

    def wait(self, layer: int) -> bool:
        """In the compute thread: what it launches next runs after layer ``layer`` landed
        (False: that layer was never queued, a launch failed)."""
        if self.failed is None and layer >= len(self.reads.events):
            self.failed = f"launched load failed: layer {layer} was not queued"
        if self.failed is None and self.reads.events[layer] is not None:
            torch.cuda.current_stream().wait_event(self.reads.events[layer])
        return self.failed is None

    async def landed(self) -> bool:
        if self.failed is None:
            try:
                await watched(self.reads.done)
                self.read_s = self.reads.seconds
            except Exception as exc:  # TransferError: past the lease, or a launch failed
                self.failed = f"launched load failed: {exc}"
        return self.failed is None

    async def settle(self) -> None:
        """Queued copies cannot be stopped: until the last one is done."""
        await settle([self.reads.done])


def start_loads(mover: RangeMover, plan: GetPlan, kv: PagedKVMemory, blocks: list[int],
                first_layer: int, lane: ThreadPoolExecutor) -> "LayerLoads | LaunchedLoads":
    """The reads of a stored prefix into ``blocks`` during the compute: on a GPU from
    same-host segments launched at once (``LaunchedLoads``), else a read per layer on the
    load lane (``LayerLoads``)."""
    if not kv.in_host_memory:
        layers = kv.num_layers
        reads = mover.launch_reads(plan, [b * layers for b in blocks], first_layer,
                                   kv.layer_nbytes, layers, lane)
        if reads is not None:
            return LaunchedLoads(reads, len(blocks) * kv.block_nbytes)
    return LayerLoads(mover, plan, kv, blocks, first_layer, lane)


@dataclass
class PartIO:
    """One request's chunk [start, end) in a step on this stage."""

    stream: KVStream
    start: int
    end: int
    loads: Optional["LayerLoads | LaunchedLoads"] = None
    load_tokens: tuple[int, int] = (0, 0)  # the loaded blocks' tokens, streamed per layer
    put: Optional[PutPlan] = None
    put_local: list[int] = field(default_factory=list)  # local block of each put key
    put_blocks: list[int] = field(default_factory=list)  # its block index in the prompt
    put_futures: list[Future] = field(default_factory=list)
    poisoned: bool = False  # computed from a failed load: streams and stores nothing
    # GPU KV, the prompt's last chunk: its store write starts once this is set (the first
    # token sampled): its DMA would hold up the sampled token's copy to the host
    hold_puts: Optional[threading.Event] = None

    def written(self) -> list[bool]:
        """Per put key: every layer's write of it finished (call once they are done)."""
        ok = not self.poisoned and all(
            f.done() and not f.cancelled() and f.exception() is None for f in self.put_futures)
        return [ok and len(self.put_futures) > 0] * (len(self.put.keys) if self.put else 0)


class StepIO:
    """The hooks of one step: ``before(layer)`` and ``after(layer)``, in the compute
    thread; they queue work on the lanes and never block but for a load."""

    def __init__(self, parts: list[PartIO], kv: PagedKVMemory, first_layer: int,
                 mover: Optional[RangeMover], store_lane: Optional[ThreadPoolExecutor],
                 layerwise: bool = True) -> None:
        self.parts = parts
        self.layerwise = layerwise  # False: the decode worker gets whole blocks afterwards
        self.kv = kv
        self.first_layer = first_layer
        self.mover = mover
        self.store_lane = store_lane

    def before(self, layer: int) -> None:
        for part in self.parts:
            if part.loads is None or part.poisoned:
                continue
            if not part.loads.wait(layer):
                part.poisoned = True
                continue
            if not part.stream.chunked:
                self._stream(part, layer, *part.load_tokens)
            elif layer == self.kv.num_layers - 1:  # every layer landed: the loaded blocks
                self._send_chunk(part, part.load_tokens[1])  # go under the last layer

    def after(self, layer: int) -> None:
        last = layer == self.kv.num_layers - 1
        for part in self.parts:
            if part.poisoned:
                continue
            if self.layerwise:
                if not part.stream.chunked:
                    self._stream(part, layer, part.start, part.end)
                elif last:
                    self._send_chunk(part, part.end)
            if part.put is not None and self.mover is not None and self.store_lane is not None:
                if self.kv.in_host_memory:
                    part.put_futures.append(self._store(part, layer))
                elif last:  # GPU KV: whole objects after the chunk (see _store_chunk)
                    part.put_futures.append(self._store_chunk(part))

    def _store_chunk(self, part: PartIO) -> Future:
        """The part's new objects (this stage's layers of them) to the store, once the
        chunk's last layer is computed: on a GPU a layer's store write costs the compute
        thread its launches per layer, and its bytes are for later requests, not this
        one's first token. The store lane launches the copy behind the compute (DMA from
        a same-host segment, else the transfer engine) and waits for it."""
        assert part.put is not None and self.mover is not None and self.store_lane is not None
        ln, layers = self.kv.layer_nbytes, self.kv.num_layers
        items = [(i, self.kv.block_address(b), self.first_layer * ln, ln * layers)
                 for i, b in enumerate(part.put_local)]
        put, mover, hold = part.put, self.mover, part.hold_puts

        def write() -> None:
            if hold is not None:  # bounded: a prompt that ends otherwise sets it too
                hold.wait(max(0.0, min(HOLD_S, put.deadline - time.time() - HOLD_S)))
            mover.write(put, items)
        return self.store_lane.submit(write)

    def _store(self, part: PartIO, layer: int) -> Future:
        """Layer ``layer`` of the part's new objects to the store, on the store lane."""
        assert part.put is not None and self.mover is not None and self.store_lane is not None
        ln = self.kv.layer_nbytes
        items = [(i, self.kv.layer_address(b, layer), (self.first_layer + layer) * ln, ln)
                 for i, b in enumerate(part.put_local)]
        return self.store_lane.submit(self.mover.write, part.put, items)

    @staticmethod
    def _send_chunk(part: PartIO, end: int) -> None:
        if not part.stream.aborted:
            try:
                part.stream.send_chunk(end)
            except RequestAborted:
                pass

    @staticmethod
    def _stream(part: PartIO, layer: int, start: int, end: int) -> None:
        if end > start and not part.stream.aborted:
            try:
                part.stream.on_layer(layer, start, end)
            except RequestAborted:  # aborted this instant: dropped after the step
                pass


async def check_loads(parts: list[PartIO]) -> None:
    """After a step: a part whose loads did not all land within their lease (launched on
    a GPU, the step could not know) is poisoned, as a failed ``LayerLoads.wait`` would."""
    for part in parts:
        if part.loads is not None and not part.poisoned and not await part.loads.landed():
            part.poisoned = True


async def settle(futures: list[Future]) -> None:
    """Wait until none of ``futures`` (writes reading our blocks, reads landing in them)
    runs any more. Each is bounded by its own deadline, so this ends."""
    pending = [watched(f) for f in futures if not f.done()]
    if pending:
        await asyncio.wait(pending)
