"""Layer-wise KV streaming from a prefill worker into a decode worker's reserved blocks.

The engine calls ``on_layer`` after each layer of each chunk (in the compute thread);
the writes for that layer are queued on one FIFO thread so they overlap with the next
layer's compute and land in order. ``wait`` collects them under a deadline.

Three paths, same semantics: the transfer engine (any host: one batch write of the layer's
pieces); on the same host, shared memory (KV in host memory: one memmove per piece into the
decode worker's mapped segment, common/kv/shm_kv.py) or CUDA IPC (KV on a GPU: one gather
and one scatter kernel into the decode worker's GPU memory, common/kv/cuda_ipc.py).
``KVPaths`` picks one per request.

A CUDA IPC stream is ``chunked``: it moves a chunk's blocks, every layer at once, right
after the chunk's last layer (``send_chunk``) instead of a layer at a time. Its copies run
at 250-500 GB/s (a 2,048-token chunk of an 8B model in ~0.5 ms) while each layer's launches
cost the compute thread more than the copy they would hide (an H200: layer-wise 1.2-1.8x
the TTFT of whole blocks after the prefill at 1k tokens; BENCHMARKS.md, "GPU KV on one
host").
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Optional

from common.kv.memory import PagedKVMemory
from common.kv.cuda_ipc import CUDA_IPC, PeerKVCuda
from common.kv.shm_kv import KV_PATHS, SHM_DIR, Peer, PeerKVMaps
from common.protocol import StreamTarget
from common.store.ranges import RangeMover
from common.transfer import TransferAgent, TransferError, watched
from common.worker_metrics import current as metrics

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SHM, TRANSFER_ENGINE = "shm", "transfer_engine"


class RequestAborted(Exception):
    """Raised inside the compute thread when the request was aborted meanwhile."""


class KVStream:
    def __init__(self, transfer: TransferAgent, executor: ThreadPoolExecutor,
                 kv: PagedKVMemory, local_blocks: list[int], remote_blocks: list[int],
                 remote_session: str, remote_base: int, peer: Optional[Peer] = None,
                 first_layer: int = 0, total_layers: Optional[int] = None) -> None:
        if len(remote_blocks) < len(local_blocks):
            raise ValueError("decode reserved fewer blocks than the prompt needs")
        # a pipeline stage writes its layers [first_layer, ...) of the peer's blocks
        self.first_layer = first_layer
        self.remote_block_nbytes = (total_layers or kv.num_layers) * kv.layer_nbytes
        self.transfer = transfer
        self.executor = executor
        self.kv = kv
        self.local = local_blocks
        self.remote = remote_blocks
        self.session = remote_session
        self.base = remote_base
        self.peer = peer  # same host: its memory mapped or opened here
        self.path = peer.via if peer is not None else TRANSFER_ENGINE
        self.futures: list[Future] = []
        self._launched: set[Future] = set()  # waits for GPU copies already queued
        self._rows: Optional[tuple] = None  # a CUDA peer's block rows on the GPU (``_launch``)
        self.bytes = 0
        self.seconds = 0.0  # first write queued → last write done
        self._started: Optional[float] = None
        self.aborted = False
        self.prefix = 0  # leading blocks sent at open or streamed as they load: never again
        self.chunked = isinstance(peer, PeerKVCuda)  # whole blocks after each chunk
        self.sent = 0  # chunked: leading blocks sent complete (the next chunk's start)

    def _remote_layer(self, block: int, layer: int) -> int:
        return (self.base + block * self.remote_block_nbytes
                + (self.first_layer + layer) * self.kv.layer_nbytes)

    def _account(self, nbytes: int) -> None:
        self.bytes += nbytes
        if self._started is None:
            self._started = time.perf_counter()

    def _queue(self, nbytes: int, job: Callable[[], int]) -> None:
        self._account(nbytes)
        self.futures.append(self.executor.submit(_as_transfer_error, job))

    def _launch(self, nbytes: int, blocks: range, layers: range) -> None:
        """A CUDA peer: queue the copy now, behind the compute (in the compute thread: no
        lane runs Python per layer); the lane only waits for its event."""
        assert isinstance(self.peer, PeerKVCuda)
        self._account(nbytes)
        try:
            if self._rows is None:
                self._rows = self.peer.rows(self.local, self.remote[:len(self.local)])
            src, dst = self._rows
            done = self.peer.launch(src[blocks.start:blocks.stop],
                                    dst[blocks.start:blocks.stop], layers)
        except (IndexError, ValueError, RuntimeError) as exc:
            failed: Future = Future()
            failed.set_exception(TransferError(f"KV write failed: {exc}"))
            self.futures.append(failed)
            return
        waited = self.executor.submit(_waited, done, nbytes)
        self._launched.add(waited)
        self.futures.append(waited)

    def _submit(self, src: list[int], dst: list[int], lengths: list[int]) -> None:
        self._queue(sum(lengths), lambda: self.transfer.write(self.session, src, dst, lengths))

    def send_prefix(self, whole: int, cached: int) -> None:
        """At open: the prompt's first ``cached`` blocks are here already or on their way
        from the store; the first ``whole`` of them go now, all layers at once, the rest
        per layer as they land (layer_io.py). Either way they are sent once."""
        self.prefix = cached
        self.sent = whole
        self._send_blocks(0, whole)

    def rewind(self, blocks: int) -> None:
        """Blocks from ``blocks`` on are computed again (their load failed): they are sent
        again, whatever went before."""
        self.prefix = blocks
        self.sent = min(self.sent, blocks)

    def send_chunk(self, end: int) -> None:
        """A chunked stream: every layer of tokens [0, ``end``) is computed or loaded;
        their blocks not sent complete yet go now, all layers at once. A last block only
        partly filled goes again with the next chunk."""
        if self.aborted:
            raise RequestAborted()
        bs = self.kv.block_size
        self._send_blocks(self.sent, -(-end // bs))
        self.sent = end // bs

    def send_rest(self) -> None:
        """The whole-block baseline (``kv_layerwise = false``), after the prefill: every
        block past the prefix, all layers at once."""
        self._send_blocks(self.prefix, len(self.local))

    def _send_blocks(self, start: int, end: int) -> None:
        """Blocks [start, end) of the prompt, all layers at once."""
        count = end - start
        if count <= 0:
            return
        n = self.kv.block_nbytes
        local, remote = self.local[start:end], self.remote[start:end]
        if isinstance(self.peer, PeerKVCuda):
            self._launch(n * count, range(start, end), range(self.kv.num_layers))
            return
        if self.peer is not None:
            peer = self.peer
            self._queue(n * count, lambda: peer.write_blocks(local, remote))
            return
        self._submit([self.kv.block_address(b) for b in local],
                     [self._remote_layer(b, 0) for b in remote], [n] * count)

    def on_layer(self, layer: int, start: int, end: int) -> None:
        """Engine hook: tokens [start, end) of ``layer`` were just written."""
        if self.aborted:
            raise RequestAborted()
        bs = self.kv.block_size
        blocks = range(start // bs, (end - 1) // bs + 1)
        if isinstance(self.peer, PeerKVCuda):
            self._launch(self.kv.layer_nbytes * len(blocks), blocks, range(layer, layer + 1))
            return
        if self.peer is not None:
            peer = self.peer
            local = [self.local[i] for i in blocks]
            remote = [self.remote[i] for i in blocks]
            self._queue(self.kv.layer_nbytes * len(blocks),
                        lambda: peer.write_layer(local, remote, layer))
            return
        self._submit([self.kv.layer_address(self.local[i], layer) for i in blocks],
                     [self._remote_layer(self.remote[i], layer) for i in blocks],
                     [self.kv.layer_nbytes] * len(blocks))

    async def wait(self, timeout: float) -> int:
        """All queued writes done; raises TransferError on failure or deadline (counted:
        ``crescent_worker_transfer_errors_total``)."""
        try:
            return await self._wait(timeout)
        except TransferError:
            metrics().error(self.path, "decode")
            raise

    async def _wait(self, timeout: float) -> int:
        """The writes run in order on one thread, so the last one done means all are done:
        wait for the last pending one (one wake-up of the event loop, not one per layer),
        then for whatever a pool of several threads may still run."""
        if not self.futures:
            return 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pending = [f for f in self.futures if not f.done()]
        while pending:
            left = deadline - loop.time()
            done, _ = await asyncio.wait([watched(pending[-1])],
                                         timeout=max(0.0, left))
            if not done:
                raise TransferError(f"KV stream ({self.path}) missed its {timeout:.1f}s "
                                    "deadline")
            pending = [f for f in pending if not f.done()]
        for f in self.futures:
            f.result()  # the first failed write, in order, raises here
        if self._started is not None:
            self.seconds = time.perf_counter() - self._started
        return self.bytes

    def cancel(self) -> None:
        """Stop: writes not started yet never start (one already running cannot be
        stopped; ``settle`` waits for it)."""
        self.aborted = True
        for f in self.futures:
            if f not in self._launched:  # a queued GPU copy runs anyway: wait for it
                f.cancel()

    def unsettled(self) -> list[Future]:
        """Writes of this stream that may still land: queued or running, and any native
        transfer call to its peer that outlived its caller's deadline."""
        pending = [f for f in self.futures if not f.done()]
        if self.peer is None:
            pending += self.transfer.in_flight(self.session)
        return pending

    async def settle(self, report_s: float = 30.0) -> None:
        """Cancel, then wait until nothing of this stream can land any more, as long as
        that takes (logged every ``report_s``): its blocks must not be reused before."""
        self.cancel()
        while pending := self.unsettled():
            done, _ = await asyncio.wait([watched(f) for f in pending],
                                         timeout=report_s)
            if not done:
                log.warning("KV stream to %s: %d writes still running after %.0fs", self.session,
                            len(pending), report_s)


def _waited(done: Optional["torch.cuda.Event"], nbytes: int) -> int:
    """On the lane: until a queued GPU copy is done (the GIL released meanwhile)."""
    if done is not None:
        done.synchronize()
    return nbytes


def _as_transfer_error(job: Callable[[], int]) -> int:
    """Run one write; a bad block id or a broken mapping fails the stream like a failed
    transfer (the caller reports kv_transfer_failed) instead of as an internal error."""
    try:
        return job()
    except TransferError:
        raise
    except (IndexError, ValueError, RuntimeError, OSError) as exc:
        raise TransferError(f"KV write failed: {exc}") from exc


class KVPaths:
    """Which path a request's KV takes to its decode worker.

    ``mode``: "transfer_engine" always; "auto" the same-host path when the decode worker
    advertised one and runs on this host (same ``host_id``); "shm" the same-host path
    whenever one is advertised (the host check skipped). The same-host path is the decode
    worker's /dev/shm file for KV in host memory, its CUDA IPC handle for KV on a GPU.
    Either falls back to the transfer engine, with a warning, when it cannot be opened.
    """

    def __init__(self, mode: str, kv: PagedKVMemory, host_id: str,
                 shm_dir: str = SHM_DIR, first_layer: int = 0,
                 total_layers: Optional[int] = None) -> None:
        if mode not in KV_PATHS:
            raise ValueError(f"kv_path must be one of {KV_PATHS}, got {mode!r}")
        self.mode = mode
        self.host_id = host_id
        self.window = (first_layer, total_layers)  # a pipeline stage's layers of a block
        self.maps = PeerKVMaps(kv, shm_dir, first_layer, total_layers)
        self.host_memory = kv.in_host_memory
        self.bytes: dict[str, int] = {SHM: 0, CUDA_IPC: 0, TRANSFER_ENGINE: 0}
        self.streams: dict[str, int] = {SHM: 0, CUDA_IPC: 0, TRANSFER_ENGINE: 0}

    def peer(self, target: StreamTarget) -> Optional[Peer]:
        if self.mode == TRANSFER_ENGINE:
            return None
        if self.mode == "auto" and target.host_id != self.host_id:
            return None
        if self.host_memory:
            return self.maps.get(target.decode_id, target.shm_path) if target.shm_path else None
        return self.maps.get_cuda(target.decode_id, target.ipc) if target.ipc else None

    def open(self, transfer: TransferAgent, executor: ThreadPoolExecutor, kv: PagedKVMemory,
             table: list[int], target: StreamTarget) -> KVStream:
        """The stream to ``target`` on the path chosen for its decode worker."""
        return KVStream(transfer, executor, kv, table, target.block_ids, target.session,
                        target.kv_base, self.peer(target), *self.window)

    def moved(self, mover: Optional[RangeMover],
              hidden: Optional[dict[str, int]] = None) -> dict[str, int]:
        """Bytes moved so far by flow/path (a worker heartbeat's ``kv_bytes``): KV to decode
        workers by this object's streams, to and from the store by ``mover``, and
        ``hidden`` (bytes by path) to the next pipeline stage."""
        out = {f"decode/{path}": n for path, n in self.bytes.items()}
        out |= {f"hidden/{path}": n for path, n in (hidden or {}).items()}
        return out | (mover.moved() if mover is not None else {})

    def done(self, stream: KVStream) -> None:
        """Account a finished stream by path (what /debug and the logs report)."""
        self.bytes[stream.path] += stream.bytes
        self.streams[stream.path] += 1
        metrics().moved("decode", stream.path, stream.bytes)
        if self.streams[stream.path] == 1:
            log.info("first KV stream via %s: %d bytes in %.3fs", stream.path, stream.bytes,
                     stream.seconds)
        log.debug("KV stream via %s: %d bytes in %.3fs", stream.path, stream.bytes,
                  stream.seconds)

    def close(self) -> None:
        self.maps.close()
