"""Same-host KV handover between GPU workers: the decode worker's KV memory opened through
CUDA IPC.

The GPU analog of ``common/kv/shm_kv.py``. A decode worker whose KV memory is on a GPU
exports a CUDA IPC handle of it when it registers (``export``); a prefill worker on the same
host opens it once (``open_peer``: ``cudaIpcOpenMemHandle``, the mechanism of the transfer
engine's ``nvlink_intra`` and of torch.multiprocessing) and copies each layer's KV into the
reserved blocks with one gather and one scatter kernel on a side stream
(``common/kv/rows.py``), after the compute that wrote it, instead of the transfer engine's
TCP loopback (1.4 GB/s measured on an H100; the engine's ``nvlink_intra`` moved 1.4 TB/s in
one piece but costs 6 us per scattered piece, issue 26). Between two GPUs of one host the
same handle opens over NVLink or PCIe peer access; a peer on another device than ours is
not used (the transfer engine is), since one stream orders the copy.

The handle is torch's (``reduce_tensor``): the allocation's IPC handle, its size and offset,
and the producer's reference counter, which keeps the decode worker's memory alive while a
prefill worker holds it open. It travels as one string of comma-separated fields.
"""
from __future__ import annotations

import logging
from dataclasses import astuple, dataclass
from typing import Optional, Sequence

import torch

from common.kv.memory import PagedKVMemory
from common.kv.rows import copy_rows, launch, rows_view

log = logging.getLogger(__name__)

CUDA_IPC = "cuda_ipc"


@dataclass(frozen=True)
class IpcHandle:
    """What opens another process's KV memory on this host (torch's CUDA IPC fields)."""

    device: int
    handle: bytes
    storage_nbytes: int
    storage_offset: int  # of the storage in the CUDA allocation
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync: bool
    offset: int  # of the KV tensor's first byte in the storage
    nbytes: int  # of the KV tensor

    def encode(self) -> str:
        return ",".join(v.hex() if isinstance(v, bytes) else str(int(v)) for v in astuple(self))

    @classmethod
    def decode(cls, text: str) -> "IpcHandle":
        """Raises ValueError on anything that is not an encoded handle."""
        f = text.split(",")
        if len(f) != 10:
            raise ValueError(f"a CUDA IPC handle has 10 fields, not {len(f)}")
        return cls(int(f[0]), bytes.fromhex(f[1]), int(f[2]), int(f[3]), bytes.fromhex(f[4]),
                   int(f[5]), bytes.fromhex(f[6]), bool(int(f[7])), int(f[8]), int(f[9]))


def export(kv: PagedKVMemory) -> Optional[str]:
    """``kv``'s memory as an encoded handle same-host peers open; None for host memory or
    where CUDA IPC is not available (the peers use the transfer engine)."""
    if kv.in_host_memory:
        return None
    from torch.multiprocessing.reductions import reduce_tensor

    flat = kv.data.view(-1).view(torch.uint8)
    try:
        _, a = reduce_tensor(flat)
    except RuntimeError as exc:
        log.warning("KV memory not exported through CUDA IPC (%s): peers use the transfer "
                    "engine", exc)
        return None
    # a: tensor class, size, stride, offset, storage class, dtype, device, handle, storage
    # bytes, storage offset, requires_grad, ref counter, its offset, event, event sync
    return IpcHandle(int(a[6]), a[7], a[8], a[9], a[11], a[12], a[13] or b"", bool(a[14]),
                     int(a[3]), flat.numel()).encode()


def open_peer(text: str, device: torch.device) -> torch.Tensor:
    """The peer's KV memory here, as a flat uint8 tensor on ``device``. Raises ValueError
    (bad handle, another device) or RuntimeError (CUDA could not open it)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    h = IpcHandle.decode(text)
    if device.type != "cuda" or h.device != (device.index or 0):
        raise ValueError(f"the peer's KV is on cuda:{h.device}, ours on {device}")
    if h.offset < 0 or h.nbytes <= 0 or h.offset + h.nbytes > h.storage_nbytes:
        raise ValueError(f"a {h.nbytes}-byte tensor at {h.offset} does not fit its "
                         f"{h.storage_nbytes}-byte storage")
    return rebuild_cuda_tensor(torch.Tensor, (h.nbytes,), (1,), h.offset, torch.UntypedStorage,
                               torch.uint8, h.device, h.handle, h.storage_nbytes,
                               h.storage_offset, False, h.ref_counter, h.ref_counter_offset,
                               h.event or None, h.event_sync)


class PeerKVCuda:
    """A same-host decode worker's GPU KV memory opened here. A block of the peer holds every
    layer of the model; a pipeline stage writes its window of layers. Copies move rows of
    one layer of one block (``copy_rows``) on a stream of their own.

    ``rows`` (once per request) checks its block pairs and puts their first rows on the
    GPU; ``launch`` (in the compute thread, right after the layer's kernels) queues the
    copy of some of those blocks' layers behind the compute launched so far and returns an
    event that fires when it is done: the compute never waits, and no lane runs Python per
    layer. ``write_layer`` / ``write_blocks`` do both and wait (``PeerKV``'s interface).

    ``open`` opens a peer's handle; the constructor takes any flat uint8 ``memory`` on the
    local KV's device: host tensors run the same code synchronously (the CPU tests)."""

    via = CUDA_IPC  # the path name in metrics

    @classmethod
    def open(cls, handle: str, local: PagedKVMemory, first_layer: int = 0,
             total_layers: Optional[int] = None) -> "PeerKVCuda":
        return cls(open_peer(handle, local.data.device), local, first_layer, total_layers)

    def __init__(self, memory: torch.Tensor, local: PagedKVMemory, first_layer: int = 0,
                 total_layers: Optional[int] = None) -> None:
        total = local.window(first_layer, total_layers)
        self.local = local
        self.total = total
        self.first = first_layer
        self.memory = memory
        ln = local.layer_nbytes
        if self.memory.numel() % (total * ln):
            raise ValueError(f"{self.memory.numel()} bytes is not a whole number of "
                             f"{total * ln}-byte blocks (KV layouts differ)")
        self.num_blocks = self.memory.numel() // (total * ln)
        self._src = rows_view(local.data.view(-1).view(torch.uint8), ln)  # rows: block, layer
        self._dst = rows_view(self.memory, ln)
        self._layers = torch.arange(local.num_layers, device=local.data.device)
        self._stream = torch.cuda.Stream(local.data.device) if local.data.is_cuda else None

    def describe(self) -> str:
        return f"CUDA IPC ({self.memory.device}, {self.num_blocks} blocks)"

    def rows(self, local: Sequence[int], remote: Sequence[int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer 0's row of each local block and of its peer block, on the GPU. Raises
        IndexError for a block outside either memory."""
        if len(local) != len(remote):
            raise ValueError(f"{len(local)} local blocks for {len(remote)} remote ones")
        for blocks, count, whose in ((local, self.local.num_blocks, "local"),
                                     (remote, self.num_blocks, "remote")):
            bad = [b for b in blocks if not 0 <= b < count]
            if bad:
                raise IndexError(f"{whose} block {bad[0]} outside [0, {count})")
        device = self.local.data.device
        src = torch.tensor(local, dtype=torch.long) * self.local.num_layers
        dst = torch.tensor(remote, dtype=torch.long) * self.total + self.first
        return src.to(device, non_blocking=True), dst.to(device, non_blocking=True)

    def launch(self, src: torch.Tensor, dst: torch.Tensor, layers: range
               ) -> Optional["torch.cuda.Event"]:
        """Queue the copy of ``layers`` of the blocks whose first rows are ``src`` → ``dst``
        (slices of ``rows``) after the work launched so far on this thread's stream; the
        event that fires once it is done (None: host memory, done already)."""
        if not (0 <= layers.start and layers.stop <= self.local.num_layers):
            raise IndexError(f"layers {layers} outside [0, {self.local.num_layers})")
        return launch(self._stream, lambda: self._copy(src, dst, layers))[1]

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, layers: range) -> None:
        if len(layers) == 1:
            s, d = src + layers.start, dst + layers.start
        else:
            offsets = self._layers[layers.start:layers.stop]
            s = (src[:, None] + offsets).reshape(-1)
            d = (dst[:, None] + offsets).reshape(-1)
        copy_rows(self._src, self._dst, s, d)

    def _write(self, local: Sequence[int], remote: Sequence[int], layers: range) -> int:
        done = self.launch(*self.rows(local, remote), layers)
        if done is not None:
            done.synchronize()
        return len(local) * len(layers) * self.local.layer_nbytes

    def write_layer(self, local: Sequence[int], remote: Sequence[int], layer: int) -> int:
        """Layer ``layer`` of local blocks → the same layer of the peer's blocks. Bytes."""
        return self._write(local, remote, range(layer, layer + 1))

    def write_blocks(self, local: Sequence[int], remote: Sequence[int]) -> int:
        """Whole blocks (every layer of this stage) → the peer's blocks. Bytes."""
        return self._write(local, remote, range(self.local.num_layers))

    def close(self) -> None:
        """Drop our reference (the IPC mapping closes with the last tensor using it)."""
        self.memory = self._dst = torch.empty(0, dtype=torch.uint8)
