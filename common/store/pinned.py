"""A same-host store node's segment registered as pinned memory: how a GPU worker's KV
reaches the store on its own host.

A memmove cannot read GPU memory, so a GPU worker used to send every store byte through the
transfer engine's TCP loopback (1.4 GB/s on an H100, issue 26). Registered with
``cudaHostRegister`` (default flags: mapped and portable on a host with unified addressing),
the mapping of the node's /dev/shm file is both a host tensor the copy engine reads and
writes by DMA (55 GB/s each way measured) and, at the same address, memory a kernel can
gather from or scatter to (``common/kv/rows.py`` picks per call). The registration is
undone before the mapping closes (``SegmentMaps``' ``on_close``).
"""
from __future__ import annotations

import logging

import torch

from common.store.shm import Segment

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
