"""Same-host KV handover through shared memory.

A worker's paged KV tensor lives in a /dev/shm file (``PagedKVMemory(shm_path=...)``); it
advertises the file and its host identity when it registers. A prefill worker on the same
host maps the decode worker's file once (``PeerKVMaps``) and writes each layer's KV into
the reserved blocks with one tensor copy per layer instead of a TCP loopback transfer.
The transfer engine still registers the same memory for peers on other hosts.

Files are named ``crescent-kv-<instance>-<pid>``: created exclusively, unlinked when the
worker closes, at exit, and by the next worker that finds one whose process is gone.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import socket
import threading
from functools import lru_cache
from typing import Optional

import torch

from common.kv.memory import PagedKVMemory
from common.store.shm import Segment

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^crescent-kv-.+-(\d+)$")


@lru_cache(maxsize=1)
def host_id() -> str:
    """Who shares /dev/shm with whom: hostname and kernel boot id (a container on another
    host, or this host after a reboot, differs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def segment_path(instance_id: str, directory: str = SHM_DIR) -> Optional[str]:
    """Where this process's KV segment goes; None where there is no such directory."""
    if not os.path.isdir(directory):
        return None
    return os.path.join(directory, f"crescent-kv-{instance_id}-{os.getpid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink KV segments left by processes that no longer exist (a SIGKILLed worker)."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("removed %d stale KV segment(s) from %s", len(removed), directory)
    return removed


KV_PATHS = ("auto", "shm", "transfer_engine")


def worker_segment(instance_id: str, kv_path: str, device: str) -> Optional[str]:
    """The file a worker's KV memory should live in (None: private memory), after
    sweeping segments of dead workers. Only host memory can be shared; ``kv_path =
    "transfer_engine"`` keeps the memory private, as before this path existed."""
    if kv_path not in KV_PATHS:
        raise ValueError(f"kv_path must be one of {KV_PATHS}, got {kv_path!r}")
    if kv_path == "transfer_engine" or torch.device(device).type != "cpu":
        return None
    sweep_stale()
    return segment_path(instance_id)


def close_at_exit(kv: PagedKVMemory) -> None:
    """Unlink ``kv``'s file at interpreter exit too (close() is idempotent)."""
    atexit.register(kv.close)


_single = threading.local()


def _one_thread() -> None:
    """Copies run on the stream thread next to the compute thread: keep them to one core
    (torch's OpenMP thread count is per calling thread)."""
    if not getattr(_single, "set", False):
        torch.set_num_threads(1)
        _single.set = True


class PeerKV:
    """A same-host peer's KV segment mapped here, in the local memory's layout.

    ``rows`` indexes one layer of one block: row ``block * num_layers + layer``; ``blocks``
    one whole block. Copies are tensor ops (index_select into a reused buffer, then
    index_copy_), one per layer or per set of whole blocks.
    """

    def __init__(self, path: str, local: PagedKVMemory) -> None:
        size = os.stat(path).st_size
        if size == 0 or size % local.block_nbytes:
            raise OSError(f"{path}: {size} bytes is not a whole number of "
                          f"{local.block_nbytes}-byte blocks (KV layouts differ)")
        self.path = path
        self.local = local
        self.num_blocks = size // local.block_nbytes
        self.segment = Segment(size, path)
        raw = torch.frombuffer(self.segment.view(0, size), dtype=torch.uint8).view(local.dtype)
        nl = local.num_layers
        self.rows = raw.view(self.num_blocks * nl, -1)
        self.blocks = raw.view(self.num_blocks, -1)
        self._src_rows = local.data.view(local.num_blocks * nl, -1)
        self._src_blocks = local.data.view(local.num_blocks, -1)
        self._buf: Optional[torch.Tensor] = None

    def _check(self, local: list[int], remote: list[int]) -> None:
        if len(local) != len(remote):
            raise ValueError(f"{len(local)} local blocks for {len(remote)} remote ones")
        for b in remote:
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"remote block {b} outside [0, {self.num_blocks})")

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor,
              dst_idx: torch.Tensor) -> int:
        _one_thread()
        n = src_idx.numel() * src.shape[1]
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(n, dtype=src.dtype)
        buf = self._buf[:n].view(src_idx.numel(), src.shape[1])
        torch.index_select(src, 0, src_idx, out=buf)
        dst.index_copy_(0, dst_idx, buf)
        return n * src.element_size()

    def write_layer(self, local: list[int], remote: list[int], layer: int) -> int:
        """Layer ``layer`` of local blocks → the same layer of the peer's blocks. Bytes."""
        self._check(local, remote)
        nl = self.local.num_layers
        lo = torch.tensor(local, dtype=torch.long) * nl + layer
        rm = torch.tensor(remote, dtype=torch.long) * nl + layer
        return self._copy(self._src_rows, self.rows, lo, rm)

    def write_blocks(self, local: list[int], remote: list[int]) -> int:
        """Whole blocks (every layer) → the peer's blocks. Bytes."""
        self._check(local, remote)
        return self._copy(self._src_blocks, self.blocks, torch.tensor(local, dtype=torch.long),
                          torch.tensor(remote, dtype=torch.long))

    def close(self) -> None:
        self.rows = self.blocks = torch.empty(0)
        self._buf = None
        self.segment.close()


class PeerKVMaps:
    """One mapping per peer instance, opened on first use and kept; reopened when the
    peer advertises another file (it restarted); a file that cannot be mapped is
    remembered as such (the caller uses the transfer engine) until the path changes."""

    def __init__(self, local: PagedKVMemory) -> None:
        self.local = local
        self._maps: dict[str, tuple[str, Optional[PeerKV]]] = {}

    def get(self, instance_id: str, path: str) -> Optional[PeerKV]:
        cached = self._maps.get(instance_id)
        if cached is not None and cached[0] == path:
            return cached[1]
        if cached is not None and cached[1] is not None:
            cached[1].close()
        peer: Optional[PeerKV] = None
        try:
            peer = PeerKV(path, self.local)
            log.info("KV to %s over shared memory (%s, %d blocks)", instance_id, path,
                     peer.num_blocks)
        except (OSError, ValueError) as exc:
            log.warning("cannot map %s's KV segment %s (%s): using the transfer engine",
                        instance_id, path, exc)
        self._maps[instance_id] = (path, peer)
        return peer

    def close(self) -> None:
        for _, peer in self._maps.values():
            if peer is not None:
                peer.close()
        self._maps.clear()
