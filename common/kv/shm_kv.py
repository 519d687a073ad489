"""Same-host KV handover through shared memory.

A worker's paged KV tensor lives in a /dev/shm file (``PagedKVMemory(shm_path=...)``); it
advertises the file and its host identity when it registers. A prefill worker on the same
host maps the decode worker's file once (``PeerKVMaps``) and copies each layer's KV into
the reserved blocks (one job per layer, one memmove per piece) instead of sending it
through the transfer engine's TCP loopback.
The transfer engine still registers the same memory for peers on other hosts.

Files are named ``crescent-kv-<hostname>-<instance>-<pid>``: created exclusively, unlinked
when the worker closes, at exit, and by the next worker on this host that finds one whose
process is gone.
"""
from __future__ import annotations

import atexit
import logging
import os
from typing import Callable, Optional, Sequence, Union

import torch

from common.kv.cuda_ipc import PeerKVCuda
from common.kv.memory import PagedKVMemory
from common.security import KV_SEGMENT, checked_shm_path
from common.store.shm import Segment, copy_many, owned_path, sweep_dead
from common.transfer import coalesce

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


def segment_path(instance_id: str, directory: str = SHM_DIR) -> Optional[str]:
    """Where this process's KV segment goes; None where there is no such directory."""
    if not os.path.isdir(directory):
        return None
    return owned_path(directory, "kv", instance_id)


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink KV segments left by processes that no longer exist (a SIGKILLed worker)."""
    return sweep_dead(directory, "kv")


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


class PeerKV:
    """A same-host peer's KV segment mapped here, in the local memory's layout.

    Writes are ``memmove``s of whole contiguous pieces (one layer of one block, or whole
    blocks, adjacent pieces merged), issued per layer from the stream thread with the GIL
    released: one copy of each byte, no temporary, no OpenMP team next to the compute
    thread's (two tensor ops per layer — index_select into a buffer, then index_copy_ —
    move each byte twice and ran ~2x slower in benchmarks/kv_path.py). Every block id is
    bounds-checked before any address is formed. ``rows``/``blocks`` are tensor views of
    the mapping (for checks and tests).
    """

    via = "shm"  # the path name in metrics

    def __init__(self, path: str, local: PagedKVMemory, first_layer: int = 0,
                 total_layers: Optional[int] = None) -> None:
        # a pipeline stage's blocks are its window of the peer's blocks
        total = local.window(first_layer, total_layers)
        self.block_nbytes = total * local.layer_nbytes  # a peer block: every layer
        self.first_offset = first_layer * local.layer_nbytes
        size = os.stat(path).st_size
        if size == 0 or size % self.block_nbytes:
            raise OSError(f"{path}: {size} bytes is not a whole number of "
                          f"{self.block_nbytes}-byte blocks (KV layouts differ)")
        self.path = path
        self.local = local
        self.num_blocks = size // self.block_nbytes
        self.segment = Segment(size, path)
        # Held by every copy while it runs: the mapping cannot be unmapped under it.
        self._view: Optional[memoryview] = self.segment.view(0, size)
        raw = torch.frombuffer(self._view, dtype=torch.uint8).view(local.dtype)
        self.rows = raw.view(self.num_blocks * total, -1)
        self.blocks = raw.view(self.num_blocks, -1)

    def _check(self, local: Sequence[int], remote: Sequence[int]) -> None:
        if len(local) != len(remote):
            raise ValueError(f"{len(local)} local blocks for {len(remote)} remote ones")
        if local and (min(local) < 0 or max(local) >= self.local.num_blocks):
            raise IndexError(f"local blocks {list(local)} outside [0, {self.local.num_blocks})")
        if remote and (min(remote) < 0 or max(remote) >= self.num_blocks):
            bad = next(b for b in remote if not 0 <= b < self.num_blocks)
            raise IndexError(f"remote block {bad} outside [0, {self.num_blocks})")

    def _copy(self, local: Sequence[int], remote: Sequence[int], offset: int, n: int) -> int:
        """memmove ``n`` bytes at ``offset`` in each local block to the same offset in the
        matching peer block (within this stage's window); adjacent pieces merged."""
        self._check(local, remote)
        view = self._view  # keeps the mapping alive until this copy is done
        if view is None:
            raise OSError(f"{self.path} is no longer mapped")
        bn, rbn = self.local.block_nbytes, self.block_nbytes
        src0 = self.local.base_address + offset
        dst0 = self.segment.base + self.first_offset + offset
        src = [src0 + b * bn for b in local]
        dst = [dst0 + b * rbn for b in remote]
        if n == bn == rbn:
            src, dst, lengths = coalesce(src, dst, [n] * len(src))
            return copy_many(list(zip(dst, src, lengths)))
        return copy_many([(d, s, n) for s, d in zip(src, dst)])

    def describe(self) -> str:
        return f"shared memory ({self.path}, {self.num_blocks} blocks)"

    def write_layer(self, local: Sequence[int], remote: Sequence[int], layer: int) -> int:
        """Layer ``layer`` of local blocks → the same layer of the peer's blocks. Bytes."""
        if not 0 <= layer < self.local.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.local.num_layers})")
        ln = self.local.layer_nbytes
        return self._copy(local, remote, layer * ln, ln)

    def write_blocks(self, local: Sequence[int], remote: Sequence[int]) -> int:
        """Whole blocks (every layer) → the peer's blocks. Bytes."""
        return self._copy(local, remote, 0, self.local.block_nbytes)

    def close(self) -> None:
        """Unmap (deferred to the last running copy, if one still runs)."""
        self.rows = self.blocks = torch.empty(0)
        self._view = None
        self.segment.close()


Peer = Union["PeerKV", PeerKVCuda]


class PeerKVMaps:
    """One mapping per peer instance, opened on first use and kept; reopened when the
    peer advertises another file or CUDA IPC handle (it restarted); one that cannot be
    opened is remembered as such (the caller uses the transfer engine) until it changes."""

    def __init__(self, local: PagedKVMemory, directory: str = SHM_DIR, first_layer: int = 0,
                 total_layers: Optional[int] = None) -> None:
        self.local = local
        self.window = (first_layer, total_layers)  # a pipeline stage's layers (PeerKV)
        self.directory = directory  # only KV segment files in it are mapped
        self._maps: dict[str, tuple[str, Optional[Peer]]] = {}

    def get(self, instance_id: str, path: str) -> Optional[PeerKV]:
        """The peer's /dev/shm KV file, mapped (host memory)."""
        # a peer-named path: only a worker's KV file (never /etc/passwd, a symlink)
        return self._get(instance_id, path, f"KV segment {path}", lambda: PeerKV(
            checked_shm_path(path, self.directory, KV_SEGMENT), self.local, *self.window))

    def get_cuda(self, instance_id: str, handle: str) -> Optional[PeerKVCuda]:
        """The peer's GPU KV memory, opened through its CUDA IPC handle."""
        return self._get(instance_id, handle, "GPU KV memory (CUDA IPC)",
                         lambda: PeerKVCuda.open(handle, self.local, *self.window))

    def _get(self, instance_id: str, key: str, what: str,
             open_peer: Callable[[], Peer]) -> Optional[Peer]:
        cached = self._maps.get(instance_id)
        if cached is not None and cached[0] == key:
            return cached[1]
        if cached is not None and cached[1] is not None:
            cached[1].close()
        peer: Optional[Peer] = None
        try:
            peer = open_peer()
            log.info("KV to %s over %s", instance_id, peer.describe())
        except (OSError, ValueError, RuntimeError) as exc:
            log.warning("cannot open %s's %s (%s): using the transfer engine", instance_id,
                        what, exc)
        self._maps[instance_id] = (key, peer)
        return peer

    def close(self) -> None:
        for _, peer in self._maps.values():
            if peer is not None:
                peer.close()
        self._maps.clear()
