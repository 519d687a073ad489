"""A same-host store node's segment registered as pinned memory: how a GPU worker's KV
reaches the store on its own host.

A memmove cannot read GPU memory, so a GPU worker used to send every store byte through the
transfer engine's TCP loopback (1.4 GB/s on an H100, issue 26). Registered with
``cudaHostRegister`` (default flags: mapped and portable on a host with unified addressing),
the mapping of the node's /dev/shm file is both a host tensor the copy engine reads and
writes by DMA and, at the same address, memory a kernel can gather from or scatter to
(``common/kv/rows.py`` picks per call): 47-48 GB/s each way for a 4k prompt of an 8B
model on an H200 (BENCHMARKS.md, "GPU KV on one host"). The registration is undone before
the mapping closes (``SegmentMaps``' ``on_close``). ``DeviceCopies`` is a GPU worker's
``RangeMover``'s way through it.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from common.kv import dma2d
from common.kv.rows import copy_pieces, copy_rows, on_stream, rows_view
from common.store.shm import Segment
from common.transfer import TransferError

log = logging.getLogger(__name__)

PINNED = "pinned"
STAGING_BYTES = 256 << 20  # a launched read's staging buffer on the GPU, at most


class _DeviceArray:
    """Host memory a kernel may address (registered, unified addressing), as a CUDA array
    torch wraps without copying."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "version": 3}


class PinnedSegment:
    """``segment`` registered with CUDA: ``host`` (CPU view, for DMA) and ``device`` (CUDA
    view of the same bytes, for kernels). Raises RuntimeError where registration fails."""

    def __init__(self, segment: Segment, device: torch.device) -> None:
        self.address, self.nbytes = segment.base, segment.nbytes
        rc = torch.cuda.cudart().cudaHostRegister(self.address, self.nbytes, 0)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes >> 20} MiB failed ({rc})")
        self.host = torch.frombuffer(segment.view(0, self.nbytes), dtype=torch.uint8)
        self.device = torch.as_tensor(_DeviceArray(self.address, self.nbytes), device=device)
        log.info("store segment %s (%d MiB) registered as pinned memory", segment.path,
                 self.nbytes >> 20)

    def close(self) -> None:
        """Unregister (before the segment is unmapped); the views are dropped."""
        self.host = self.device = torch.empty(0, dtype=torch.uint8)
        torch.cuda.cudart().cudaHostUnregister(self.address)


# (key position, local address, offset in the segment, nbytes): ranges.py's ``_Piece``
Piece = tuple[int, int, int, int]


class DeviceCopies:
    """A GPU worker's copies between its KV (``memory``, flat uint8) and same-host store
    segments, for its ``RangeMover``: each segment pinned once (``pinned``), unpinned
    before its mapping closes (``unpin``); one stream per direction. ``copy`` moves a
    call's pieces and waits (a lane thread); ``launch_reads`` queues a stored prefix's
    reads a layer at a time, each with an event the compute waits for on the GPU, the
    lane only waiting for the last. ``count`` / ``failed``: the mover's byte and failure
    accounts."""

    def __init__(self, memory: torch.Tensor, count: Callable[[bool, str, int], None],
                 failed: Callable[[str, str], None]) -> None:
        self.memory = memory
        self.count, self.failed = count, failed
        self.pin_segment: Callable[[Segment, torch.device], Any] = PinnedSegment  # tests
        self._pinned: dict[int, Any] = {}  # id(mapping) → its PinnedSegment, False: failed
        self._streams: dict[bool, Optional[torch.cuda.Stream]] = {}

    def covers(self, pieces: list[Piece]) -> bool:
        """Every piece's local bytes are in the KV memory."""
        lo = self.memory.data_ptr()
        hi = lo + self.memory.numel()
        return all(lo <= addr and addr + n <= hi for _, addr, _, n in pieces)

    def pinned(self, seg: Segment, node_id: str) -> Optional[Any]:
        """``seg`` (a node's mapping here) registered, once; None where CUDA refused."""
        pinned = self._pinned.get(id(seg))
        if pinned is None:
            try:
                pinned = self.pin_segment(seg, self.memory.device)
            except RuntimeError as exc:
                log.warning("node %s: segment not pinned (%s): using the transfer engine",
                            node_id, exc)
                pinned = False
            self._pinned[id(seg)] = pinned
        return pinned or None

    def unpin(self, seg: Segment) -> None:
        """A mapping closes (``SegmentMaps.on_close``): unregister it first."""
        pinned = self._pinned.pop(id(seg), None)
        if pinned:
            pinned.close()

    def _stream(self, write: bool) -> Optional[torch.cuda.Stream]:
        """The direction's stream; None for host memory (tests): copies are synchronous."""
        if write not in self._streams:
            self._streams[write] = (torch.cuda.Stream(self.memory.device)
                                    if self.memory.is_cuda else None)
        return self._streams[write]

    def copy(self, node_id: str, seg: Any, pieces: list[Piece], write: bool) -> bool:
        """KV ↔ a pinned segment, on the direction's stream, until done; a write waits for
        the compute launched before it (the KV it sends)."""
        local, base = self.memory, self.memory.data_ptr()
        if write:
            ps = [(addr - base, off, n) for _, addr, off, n in pieces]
            copy = lambda: copy_pieces(local, seg.device, ps, dst_dma=seg.host)  # noqa: E731
        else:
            ps = [(off, addr - base, n) for _, addr, off, n in pieces]
            copy = lambda: copy_pieces(seg.device, local, ps, src_dma=seg.host)  # noqa: E731
        try:
            nbytes = on_stream(self._stream(write), copy, after_compute=write)
        except (IndexError, ValueError, RuntimeError) as exc:
            self.failed(node_id, f"pinned copy: {exc}")
            return False
        self.count(write, PINNED, nbytes)
        return True

    def launch_reads(self, plan: Any, segment_of: Callable[[str], Any],
                     local_rows: Sequence[int], first_row: int, row_nbytes: int, layers: int,
                     waiter: ThreadPoolExecutor) -> Optional["LaunchedReads"]:
        """Queue the reads of ``plan`` (a GetPlan: each key's first replica) a row at a time
        (a layer of every object) on the read stream, none waiting for anything: key i's
        object row ``offset / row_nbytes + first_row + l`` → local row ``local_rows[i] + l``
        for ``l < layers``. Per layer and node: the pieces by 2D DMA into a staging buffer
        and one scatter into the KV memory (``dma2d``), or where 2D copies are not usable a
        gather kernel over the pinned mapping. None where the plan cannot go this way (an
        absent key, a node not pinnable here, a row outside either memory)."""
        by_node = plan.first_replicas()
        if by_node is None:
            return None
        rows = np.asarray(local_rows, dtype=np.int64)
        local_total = self.memory.numel() // row_nbytes
        parts = []
        for node_id, (keys, offsets) in by_node.items():
            seg = segment_of(node_id)
            dst, src = rows[keys], offsets + first_row * row_nbytes
            if seg is None or min(dst.min(), src.min()) < 0 or dst.max() + layers > local_total \
                    or src.max() + layers * row_nbytes > seg.device.numel():
                return None
            parts.append((seg, dst.tolist(), src))
        stream = self._stream(False)
        copier = dma2d.usable(self.memory.device) if stream is not None else None
        if copier is None and any((offsets % row_nbytes).any() for *_, offsets in parts):
            return None  # a kernel gathers whole rows of the segment
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            return self._launch_reads(parts, row_nbytes, layers, plan.deadline, stream,
                                      copier, waiter)

    def _launch_reads(self, parts: list, row_nbytes: int, layers: int, deadline: float,
                      stream: Optional[torch.cuda.Stream], copier: Optional[dma2d.Copier2D],
                      waiter: ThreadPoolExecutor) -> "LaunchedReads":
        """``launch_reads`` once checked, on the read stream: index tensors and staging are
        made on it too, so nothing it runs waits for, or races, another stream."""
        def whole_rows(flat: torch.Tensor) -> torch.Tensor:
            return rows_view(flat[:flat.numel() // row_nbytes * row_nbytes], row_nbytes)

        device = self.memory.device
        local = whole_rows(self.memory)
        reads = LaunchedReads(sum(len(dst) for _, dst, _ in parts) * row_nbytes * layers)
        steps = torch.arange(layers, device=device)[:, None]  # row l of a block: + l
        parts = [(seg, torch.tensor(dst).to(device, non_blocking=True) + steps, src)
                 for seg, dst, src in parts]  # [layer, piece] local rows
        if copier is not None:
            assert stream is not None
            batch = max(1, STAGING_BYTES // row_nbytes)
            reads.staging = torch.empty(min(batch, max(len(src) for *_, src in parts))
                                        * row_nbytes, dtype=torch.uint8, device=device)
            staged = rows_view(reads.staging, row_nbytes)
            base, index = reads.staging.data_ptr(), device.index or 0
            plans = [(seg.address, dst[:, a:a + batch], dma2d.runs(src[a:a + batch], row_nbytes))
                     for seg, dst, src in parts for a in range(0, len(src), batch)]

            def copy(layer: int) -> None:
                shift = layer * row_nbytes
                for address, dst, runs in plans:
                    for first, count, offset, pitch in runs:
                        copier.host_to_device(index, base + first * row_nbytes, row_nbytes,
                                              address + offset + shift, pitch, row_nbytes,
                                              count, stream.cuda_stream)
                    local.index_copy_(0, dst[layer], staged[:dst.shape[1]])
        else:
            gathers = [(whole_rows(seg.device), dst,
                        torch.from_numpy(src // row_nbytes).to(device, non_blocking=True)
                        + steps) for seg, dst, src in parts]

            def copy(layer: int) -> None:
                for seg_rows, dst, src in gathers:
                    copy_rows(seg_rows, local, src[layer], dst[layer])
        try:
            for layer in range(layers):  # on the read stream already (``launch_reads``)
                copy(layer)
                done = torch.cuda.Event() if stream is not None else None
                if done is not None:
                    done.record(stream)
                reads.events.append(done)
        except (IndexError, ValueError, RuntimeError) as exc:  # what was queued still runs
            self.failed(PINNED, f"launched reads: {exc}")
            reads.launch_failed = True  # the lane fails it once the queued part is done
        reads.done = waiter.submit(self._landed, reads, deadline)
        return reads

    def _landed(self, reads: "LaunchedReads", deadline: float) -> int:
        """In a lane: once the last layer landed (when, in ``reads.seconds``), whether it
        did within the lease (a read that ended after it may hold bytes the store has
        given to another object)."""
        if reads.events and reads.events[-1] is not None:
            reads.events[-1].synchronize()
        reads.seconds = time.perf_counter() - reads.started
        if reads.launch_failed:
            self.failed(PINNED, "a launched read failed")
            raise TransferError("store read: a launch failed")
        if time.time() > deadline:
            self.failed(PINNED, "a launched read ended past its lease")
            raise TransferError("store read: past the lease")
        self.count(False, PINNED, reads.nbytes)
        return reads.nbytes


class LaunchedReads:
    """Reads queued by ``DeviceCopies.launch_reads``: ``events[l]`` fires once layer l
    landed (None: host memory, copied already), ``done`` (a Future) once every layer did,
    raising ``TransferError`` where they ended past the lease."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.started = time.perf_counter()
        self.events: list[Optional[torch.cuda.Event]] = []
        self.done: Optional[Future] = None
        self.seconds = 0.0  # launched → the last layer landed (as the lane saw it)
        self.launch_failed = False  # some layers were never queued
        self.staging: Optional[torch.Tensor] = None  # kept until the reads are done
