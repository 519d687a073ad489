"""The only path for KV bytes: a thin wrapper over the Mooncake Transfer Engine.

Both sides register memory; ``write``/``read`` move bytes between registered regions
(no copy in Python). The engine's async status call is not usable from Python here, so
the synchronous batch calls run on a small thread pool and every awaitable has a deadline.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

log = logging.getLogger(__name__)


class TransferError(RuntimeError):
    """A transfer failed or missed its deadline; the caller falls back (recompute, retry)."""


@dataclass(frozen=True)
class TransferConfig:
    hostname: str = "127.0.0.1"
    protocol: str = "tcp"  # "rdma" on a GPU cluster
    metadata_server: str = "P2PHANDSHAKE"  # no etcd needed
    device_name: str = ""  # RDMA NIC names, comma separated
    threads: int = 4


def coalesce(
    src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """Merge pieces whose source and destination are both adjacent to the previous piece."""
    out_s: list[int] = []
    out_d: list[int] = []
    out_n: list[int] = []
    for s, d, n in zip(src, dst, lengths):
        if out_n and out_s[-1] + out_n[-1] == s and out_d[-1] + out_n[-1] == d:
            out_n[-1] += n
        else:
            out_s.append(s)
            out_d.append(d)
            out_n.append(n)
    return out_s, out_d, out_n


class TransferAgent:
    """One transfer engine per process. ``session_id`` is what peers use to reach us."""

    def __init__(self, config: Optional[TransferConfig] = None) -> None:
        from mooncake.engine import TransferEngine  # imported late: heavy native module

        self.config = config or TransferConfig()
        self._engine = TransferEngine()
        rc = self._engine.initialize(
            self.config.hostname,
            self.config.metadata_server,
            self.config.protocol,
            self.config.device_name,
        )
        if rc != 0:
            raise TransferError(f"transfer engine initialize failed (rc={rc})")
        self.session_id = f"{self.config.hostname}:{self._engine.get_rpc_port()}"
        self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix="transfer")
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}
        self.bytes_moved = 0
        self.seconds_spent = 0.0

    def register(self, address: int, nbytes: int) -> None:
        """Register a region once; registering the same region again is a no-op."""
        if self._registered.get(address) == nbytes:
            return
        rc = self._engine.register_memory(address, nbytes)
        if rc != 0:
            raise TransferError(f"register_memory({address:#x}, {nbytes}) failed (rc={rc})")
        self._registered[address] = nbytes

    def unregister(self, address: int) -> None:
        if self._registered.pop(address, None) is not None:
            self._engine.unregister_memory(address)

    def _run(self, write: bool, target: str, local: Sequence[int], remote: Sequence[int],
             lengths: Sequence[int]) -> int:
        import time

        local_c, remote_c, len_c = coalesce(local, remote, lengths)
        if not len_c:
            return 0
        start = time.perf_counter()
        if write:
            rc = self._engine.batch_transfer_sync_write(target, local_c, remote_c, len_c)
        else:
            rc = self._engine.batch_transfer_sync_read(target, local_c, remote_c, len_c)
        if rc != 0:
            raise TransferError(f"{'write' if write else 'read'} to {target} failed (rc={rc})")
        total = sum(len_c)
        with self._lock:
            self.bytes_moved += total
            self.seconds_spent += time.perf_counter() - start
        return total

    def write(self, target: str, local: Sequence[int], remote: Sequence[int],
              lengths: Sequence[int]) -> int:
        """Blocking: copy local[i] → remote[i] on ``target``. Returns bytes moved."""
        return self._run(True, target, local, remote, lengths)

    def read(self, target: str, local: Sequence[int], remote: Sequence[int],
             lengths: Sequence[int]) -> int:
        """Blocking: copy remote[i] on ``target`` → local[i]. Returns bytes moved."""
        return self._run(False, target, local, remote, lengths)

    async def write_async(self, target: str, local: Sequence[int], remote: Sequence[int],
                          lengths: Sequence[int], timeout: float) -> int:
        return await self._await(True, target, local, remote, lengths, timeout)

    async def read_async(self, target: str, local: Sequence[int], remote: Sequence[int],
                         lengths: Sequence[int], timeout: float) -> int:
        return await self._await(False, target, local, remote, lengths, timeout)

    async def _await(self, write: bool, target: str, local: Sequence[int],
                     remote: Sequence[int], lengths: Sequence[int], timeout: float) -> int:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pool, self._run, write, target, local, remote, lengths)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError as exc:
            raise TransferError(f"transfer to {target} missed its {timeout:.1f}s deadline") from exc

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
