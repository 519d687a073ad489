"""Layer-wise KV streaming from a prefill worker into a decode worker's reserved blocks.

The engine calls ``on_layer`` after each layer of each chunk (in the compute thread);
the writes for that layer are queued on one FIFO thread so they overlap with the next
layer's compute and land in order. ``wait`` collects them under a deadline.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from common.kv.memory import PagedKVMemory
from common.transfer import TransferAgent, TransferError


class RequestAborted(Exception):
    """Raised inside the compute thread when the request was aborted meanwhile."""


class KVStream:
    def __init__(self, transfer: TransferAgent, executor: ThreadPoolExecutor,
                 kv: PagedKVMemory, local_blocks: list[int], remote_blocks: list[int],
                 remote_session: str, remote_base: int) -> None:
        if len(remote_blocks) < len(local_blocks):
            raise ValueError("decode reserved fewer blocks than the prompt needs")
        self.transfer = transfer
        self.executor = executor
        self.kv = kv
        self.local = local_blocks
        self.remote = remote_blocks
        self.session = remote_session
        self.base = remote_base
        self.futures: list[Future] = []
        self.bytes = 0
        self.seconds = 0.0  # first write queued → last write done
        self._started: Optional[float] = None
        self.aborted = False

    def _remote_layer(self, block: int, layer: int) -> int:
        return self.base + block * self.kv.block_nbytes + layer * self.kv.layer_nbytes

    def _submit(self, src: list[int], dst: list[int], lengths: list[int]) -> None:
        self.bytes += sum(lengths)
        if self._started is None:
            self._started = time.perf_counter()
        self.futures.append(self.executor.submit(
            self.transfer.write, self.session, src, dst, lengths))

    def send_whole_blocks(self, count: int) -> None:
        """The first ``count`` blocks (a cached prefix): all layers at once."""
        if count <= 0:
            return
        n = self.kv.block_nbytes
        self._submit([self.kv.block_address(b) for b in self.local[:count]],
                     [self.base + b * n for b in self.remote[:count]], [n] * count)

    def on_layer(self, layer: int, start: int, end: int) -> None:
        """Engine hook: tokens [start, end) of ``layer`` were just written."""
        if self.aborted:
            raise RequestAborted()
        bs = self.kv.block_size
        first, last = start // bs, (end - 1) // bs
        blocks = range(first, last + 1)
        self._submit([self.kv.layer_address(self.local[i], layer) for i in blocks],
                     [self._remote_layer(self.remote[i], layer) for i in blocks],
                     [self.kv.layer_nbytes] * len(blocks))

    async def wait(self, timeout: float) -> int:
        """All queued writes done; raises TransferError on failure or deadline."""
        if not self.futures:
            return 0
        wrapped = [asyncio.wrap_future(f) for f in self.futures]
        try:
            await asyncio.wait_for(asyncio.gather(*wrapped), timeout)
        except asyncio.TimeoutError as exc:
            raise TransferError(f"KV stream missed its {timeout:.1f}s deadline") from exc
        if self._started is not None:
            self.seconds = time.perf_counter() - self._started
        return self.bytes

    def cancel(self) -> Optional[int]:
        self.aborted = True
        for f in self.futures:
            f.cancel()
        return None
