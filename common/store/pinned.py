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
from typing import Any, Callable, Optional, Sequence

import torch

from common.kv.rows import copy_pieces, copy_rows, launch, on_stream, rows_view
from common.store.shm import Segment
from common.transfer import TransferError

log = logging.getLogger(__name__)

PINNED = "pinned"


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
    call's pieces and waits (a lane thread); ``rows`` + ``launch_write`` write a put's
    objects a layer at a time, launched from the compute thread behind the compute, the
    lane only waiting. ``count`` / ``failed``: the mover's byte and failure accounts."""

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

    def rows(self, plan: Any, segment_of: Callable[[str], Any], local_rows: Sequence[int],
             first_row: int, row_nbytes: int, layers: int) -> Optional[tuple[Any, list, int]]:
        """For writing ``plan`` (a PutPlan) a row at a time: per replica node, its pinned
        segment's rows, and on the GPU each key's local row (``local_rows[i]``, rows of
        ``row_nbytes`` in the KV memory) and its object's row there (offset / row_nbytes +
        ``first_row``), checked once for ``layers`` rows on; with the local rows and the
        bytes one row of every object makes. None where the plan cannot go this way (a
        node not pinnable here, an object not aligned to rows)."""
        by_node: dict[str, tuple[list[int], list[int]]] = {}
        for i, replicas in enumerate(plan.replicas):
            for loc in replicas.locations:
                if loc.offset % row_nbytes:
                    return None
                src, dst = by_node.setdefault(loc.node_id, ([], []))
                src.append(local_rows[i])
                dst.append(loc.offset // row_nbytes + first_row)
        local_total = self.memory.numel() // row_nbytes
        device = self.memory.device
        out = []
        for node_id, (src, dst) in by_node.items():
            seg = segment_of(node_id)
            if seg is None:
                return None
            total = seg.device.numel() // row_nbytes
            if min(src + dst) < 0 or max(src) + layers > local_total or max(dst) + layers > total:
                return None
            out.append((rows_view(seg.device[:total * row_nbytes], row_nbytes),
                        torch.tensor(src).to(device, non_blocking=True),
                        torch.tensor(dst).to(device, non_blocking=True)))
        local = rows_view(self.memory[:local_total * row_nbytes], row_nbytes)
        return local, out, sum(len(src) for src, _ in by_node.values()) * row_nbytes

    def launch_write(self, rows: tuple[Any, list, int], row: int, deadline: float,
                     waiter: ThreadPoolExecutor) -> Future:
        """Queue row ``row`` on (a layer) of every object of ``rows``, behind the work
        launched so far on this thread's stream (the compute that wrote it); ``waiter``
        waits for it. The future fails once done past ``deadline``."""
        local, parts, nbytes = rows

        def copy() -> None:
            for seg_rows, src, dst in parts:
                copy_rows(local, seg_rows, src + row, dst + row)
        _, done = launch(self._stream(True), copy)
        return waiter.submit(self._written, done, nbytes, deadline)

    def _written(self, done: Optional[torch.cuda.Event], nbytes: int, deadline: float) -> int:
        if done is not None:
            done.synchronize()
        if time.time() > deadline:
            self.failed(PINNED, "a layer's store write ended past its deadline")
            raise TransferError("store write: past the deadline")
        self.count(True, PINNED, nbytes)
        return nbytes
