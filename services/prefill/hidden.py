"""Hidden states between the stages of a chunked-pipeline-parallel prefill group.

Stage k computes a chunk through its layers and hands the hidden states ``[tokens, hidden]``
to stage k+1. They take the same two paths as KV (issue 12): a memmove into a /dev/shm
file when both stages share a host, the transfer engine otherwise.

The receiving stage owns a ``HiddenInbox``: one region of ``slots`` equal slots, a /dev/shm
file (``crescent-hidden-<hostname>-<owner>-<pid>``, swept like KV segments when its process
is gone) registered with the transfer engine; private memory and the transfer engine only
where /dev/shm is missing or full. Its ``HiddenRoute`` (a frozen dataclass that rides in
control messages) tells a sender where the slots are. ``HiddenSender`` writes one tensor
into one slot, synchronously, on the caller's (sender) thread.

Which slot is free is the caller's business (a slot is reused once its reader acked it);
this module only moves bytes and checks bounds. benchmarks/hidden_path.py measures the
paths per size.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

import torch

from common.host import host_id
from common.kv.shm_kv import KV_PATHS, SHM_DIR
from common.security import checked_shm_path
from common.store.shm import Segment, owned_path, sweep_dead
from common.transfer import TransferAgent, TransferError

log = logging.getLogger(__name__)

KIND = "hidden"  # segment kind: crescent-hidden-<hostname>-<owner>-<pid>
HIDDEN_SEGMENT = re.compile(r"crescent-hidden-[\w.-]+-\d+")
HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHM, TRANSFER_ENGINE = "shm", "transfer_engine"
_OWNER = re.compile(r"[\w.-]+")


@dataclass(frozen=True)
class HiddenRoute:
    """Where a receiving stage's slots are: its host (``host_id()`` of common/kv/shm_kv.py),
    its /dev/shm file (None: private memory), its transfer-engine session and the address
    of slot 0 there; slot ``i`` starts ``i * slot_bytes`` after it."""

    host_id: str
    shm_path: Optional[str]
    session_id: str
    base: int
    slots: int
    slot_bytes: int

    def __post_init__(self) -> None:
        if not self.host_id or not self.session_id:
            raise ValueError("a hidden route needs a host_id and a session_id")
        if self.slots < 1 or self.slot_bytes < 1 or self.base < 0:
            raise ValueError(f"bad hidden route: {self.slots} slots of {self.slot_bytes} "
                             f"bytes at {self.base:#x}")

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes


def _check_slot(slot: int, slots: int) -> None:
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < slots:
        raise ValueError(f"slot {slot!r} outside [0, {slots})")


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden states must be one of {HIDDEN_DTYPES}, not {dtype}")


class HiddenInbox:
    """The receiving stage's ring of ``slots`` slots of ``slot_bytes`` each, in one region
    registered with ``transfer``. ``read`` returns a copy: the slot may be refilled as soon
    as the caller acks it."""

    def __init__(self, transfer: TransferAgent, owner: str, slots: int, slot_bytes: int,
                 shm_dir: str = SHM_DIR) -> None:
        if not _OWNER.fullmatch(owner):
            raise ValueError(f"owner {owner!r}: letters, digits, '_', '.', '-' only")
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"an inbox needs slots and bytes, got {slots} x {slot_bytes}")
        self.transfer = transfer
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.segment = self._segment(owner, shm_dir)
        self.transfer.register(self.segment.base, self.nbytes)
        self._bytes = torch.frombuffer(self.segment.view(0, self.nbytes), dtype=torch.uint8)
        self._closed = False

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def _segment(self, owner: str, shm_dir: str) -> Segment:
        if os.path.isdir(shm_dir):
            sweep_dead(shm_dir, KIND)
            path = owned_path(shm_dir, KIND, owner)
            try:
                return Segment(self.nbytes, path, create=True)  # exclusive, zeroed
            except OSError as exc:  # exists, or a small /dev/shm: the transfer engine only
                log.warning("hidden inbox not shared: cannot create %s (%d MiB): %s", path,
                            self.nbytes >> 20, exc)
        return Segment(self.nbytes)

    @property
    def shm_path(self) -> Optional[str]:
        return self.segment.path

    @property
    def route(self) -> HiddenRoute:
        """What a sender needs to reach these slots (this host's ``host_id()``)."""
        return HiddenRoute(host_id(), self.shm_path, self.transfer.session_id,
                           self.segment.base, self.slots, self.slot_bytes)

    def read(self, slot: int, tokens: int, hidden: int, dtype: torch.dtype,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A copy of slot ``slot`` as a ``[tokens, hidden]`` tensor of ``dtype``: a new
        tensor, or ``out`` (a buffer the caller reuses saves the page faults of a fresh
        one: ~0.4 ms per MiB here, see benchmarks/hidden_path.py)."""
        if self._closed:
            raise ValueError("the hidden inbox is closed")
        _check_slot(slot, self.slots)
        _check_dtype(dtype)
        n = tokens * hidden * dtype.itemsize
        if tokens < 1 or hidden < 1 or n > self.slot_bytes:
            raise ValueError(f"[{tokens}, {hidden}] {dtype} ({n} bytes) does not fit a "
                             f"{self.slot_bytes}-byte slot")
        start = slot * self.slot_bytes
        src = self._bytes[start:start + n].view(dtype).view(tokens, hidden)
        if out is None:
            return src.clone()
        if out.shape != src.shape or out.dtype != dtype:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, not [{tokens}, {hidden}] "
                             f"{dtype}")
        return out.copy_(src)

    def close(self) -> None:
        """Unregister (the engine then refuses late writes), unlink and unmap. Idempotent.
        Call it once the senders stopped."""
        if self._closed:
            return
        self._closed = True
        self.transfer.unregister(self.segment.base)
        self._bytes = torch.empty(0, dtype=torch.uint8)
        self.segment.close(unlink=True)


class HiddenSender:
    """Writes tensors into a receiver's slots over shared memory or the transfer engine.

    ``mode`` means what ``ClusterConfig.kv_path`` means: "transfer_engine" always; "auto"
    shared memory when the receiver advertised a file and runs on this host; "shm"
    whenever a file is advertised (the host check skipped). A file that cannot be mapped
    (or is not a hidden segment of ours) falls back to the transfer engine with a warning.
    ``path`` says which was chosen. One sender is used by one thread at a time (a lock
    serializes ``send``): the transfer engine's staging buffer is shared by its sends.
    """

    def __init__(self, transfer: TransferAgent, route: HiddenRoute, mode: str,
                 local_host_id: str, shm_dir: str = SHM_DIR) -> None:
        if mode not in KV_PATHS:
            raise ValueError(f"mode must be one of {KV_PATHS}, got {mode!r}")
        self.transfer = transfer
        self.route = route
        self._lock = threading.Lock()
        self._segment: Optional[Segment] = None
        if mode != TRANSFER_ENGINE and route.shm_path is not None and (
                mode == SHM or route.host_id == local_host_id):
            self._segment = self._map(route, shm_dir)
        self.path = SHM if self._segment is not None else TRANSFER_ENGINE
        self._staging = torch.empty(0, dtype=torch.uint8)  # registered once it is used
        self._hung: list[Future] = []  # calls past their deadline that may still read it
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._closed = False

    @staticmethod
    def _map(route: HiddenRoute, shm_dir: str) -> Optional[Segment]:
        try:
            path = checked_shm_path(route.shm_path or "", shm_dir, HIDDEN_SEGMENT)
            return Segment(route.nbytes, path)
        except (OSError, ValueError) as exc:
            log.warning("cannot map hidden inbox %s (%s): using the transfer engine",
                        route.shm_path, exc)
            return None

    def send(self, slot: int, tensor: torch.Tensor, timeout_s: float) -> int:
        """Write ``tensor``'s bytes into slot ``slot``; returns the bytes written.
        ValueError for a bad slot, dtype or size (empty included); TransferError when the
        transfer engine fails or misses ``timeout_s`` (the slot's contents are then
        undefined)."""
        _check_slot(slot, self.route.slots)
        _check_dtype(tensor.dtype)
        n = tensor.numel() * tensor.element_size()
        if not 0 < n <= self.route.slot_bytes:
            raise ValueError(f"{tuple(tensor.shape)} {tensor.dtype} is {n} bytes: not in "
                             f"(0, {self.route.slot_bytes}], the slot size")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        with self._lock:
            if self._closed:
                raise ValueError("the hidden sender is closed")
            if self._segment is None:
                return self._transfer(slot, tensor.detach(), n, timeout_s)
            src = tensor.detach().to("cpu").contiguous()  # no copy when it already is
            ctypes.memmove(self._segment.base + slot * self.route.slot_bytes, src.data_ptr(), n)
            return n

    def _transfer(self, slot: int, src: torch.Tensor, n: int, timeout_s: float) -> int:
        target = self.route.session_id
        self._hung = [f for f in self._hung if not f.done()]
        if self._hung:
            raise TransferError(f"an earlier hidden-state write to {target} is still running")
        staging = self._stage(n)
        staging[:n].view(src.dtype).view(src.shape).copy_(src)  # any device or layout
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        write = self.transfer.write_async(target, [staging.data_ptr()],
                                          [self.route.base + slot * self.route.slot_bytes],
                                          [n], timeout_s)
        try:
            return self._loop.run_until_complete(write)
        except TransferError:
            self._hung = self.transfer.in_flight(target)  # the staging buffer stays theirs
            # A call past its deadline reports to this loop when it ends; closed, the loop
            # drops that outcome instead of logging it as never retrieved.
            self._loop.close()
            self._loop = None
            raise

    def _stage(self, n: int) -> torch.Tensor:
        """A registered buffer of at least ``n`` bytes: grown (doubling, up to a slot)
        when too small; no call that could still read the old one is running."""
        if self._staging.numel() >= n:
            return self._staging
        size = min(max(n, 2 * self._staging.numel()), self.route.slot_bytes)
        new = torch.empty(size, dtype=torch.uint8)
        self.transfer.register(new.data_ptr(), size)
        if self._staging.numel():
            self.transfer.unregister(self._staging.data_ptr())
        self._staging = new
        return new

    def close(self) -> None:
        """Unmap the receiver's file, unregister the staging buffer. Idempotent. A write
        still running past its deadline keeps the buffer (it reads from it) until it ends."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._segment is not None:
                self._segment.close()
            staging, self._staging = self._staging, torch.empty(0, dtype=torch.uint8)
            hung = [f for f in self._hung if not f.done()]
            if staging.numel() and not hung:
                self._drop(staging, hung)
            for f in hung if staging.numel() else []:  # each holds the buffer till the end
                f.add_done_callback(lambda _f, s=staging: self._drop(s, hung))
            if self._loop is not None:
                self._loop.close()

    def _drop(self, staging: torch.Tensor, hung: list[Future]) -> None:
        if all(f.done() for f in hung):  # unregister is idempotent
            self.transfer.unregister(staging.data_ptr())
