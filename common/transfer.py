"""The only path for KV bytes: a thin wrapper over the Mooncake Transfer Engine.

Both sides register memory; ``write``/``read`` move bytes between registered regions
(no copy in Python). Each call runs on a small thread pool; over TCP as single-request
batches polled with pauses (``TransferAgent._polled``), never as the binding's synchronous
batch, which spins a core until the batch ends; over other protocols (RDMA, not measured
here) small pieces keep the one synchronous batch. Every wait for a call has a deadline.
A deadline cannot stop the native work: the call is still ``in_flight`` until it returns
(memory it writes must stay out of use until then), and its peer is marked bad meanwhile,
so later calls to it fail at once instead of piling up behind it.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Optional, Sequence

log = logging.getLogger(__name__)


# Over TCP every call goes the polled way (``TransferAgent._polled``), cut into requests of at
# most ``REQUEST_BYTES``. Small pieces once kept the binding's synchronous batch, no faster
# polled but spinning a core meanwhile: 16 pieces of 16 KiB cost 1.3-1.5 ms of CPU against
# 0.7, and a layer-wise prefill streaming its KV that way lost 11-17 % of its compute to it,
# 4-5 % polled (BENCHMARKS.md, Prefill, run L). The price: a call of many small pieces with
# nothing to overlap drains slower and less evenly (a store batch of 1,024 values of 64 KiB:
# 1.1-1.4 GB/s polled vs 1.2-1.5 spinning; BENCHMARKS.md, Store). Over other protocols
# (RDMA: not measured) calls whose pieces average less than ``POLLED_PIECE_BYTES`` keep the
# synchronous batch, where per-request submission could cost more than the transfer.
POLLED_PIECE_BYTES = 256 << 10
REQUEST_BYTES = 1 << 20
POLL_MIN_S, POLL_MAX_S = 50e-6, 1e-3  # the pause between polls doubles from min to max
BYTES_PER_S_FLOOR = 1 << 30  # a polled call may also take 1 s per GiB past call_timeout_s


def watched(future: Future) -> "asyncio.Future":
    """``future`` (a transfer or copy job) as an asyncio future whose failure counts as
    seen: its error is read where its outcome is, and the wrapper must not log it again as
    "Future exception was never retrieved" when it is collected (seen when a GPU's store
    writes missed their deadline)."""
    wrapper = asyncio.wrap_future(future)
    wrapper.add_done_callback(lambda f: f.cancelled() or f.exception())
    return wrapper


class TransferError(RuntimeError):
    """A transfer failed or missed its deadline; the caller falls back (recompute, retry)."""


@dataclass(frozen=True)
class TransferConfig:
    hostname: str = "127.0.0.1"
    protocol: str = "tcp"  # "rdma" on a GPU cluster
    metadata_server: str = "P2PHANDSHAKE"  # no etcd needed
    device_name: str = ""  # RDMA NIC names, comma separated
    threads: int = 8
    call_timeout_s: float = 30.0  # one native call's deadline (its caller's wait)


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


def split(src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
          max_bytes: int) -> tuple[list[int], list[int], list[int]]:
    """Cut every piece into consecutive pieces of at most ``max_bytes``."""
    out_s: list[int] = []
    out_d: list[int] = []
    out_n: list[int] = []
    for s, d, n in zip(src, dst, lengths):
        for off in range(0, n, max_bytes):
            out_s.append(s + off)
            out_d.append(d + off)
            out_n.append(min(max_bytes, n - off))
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
        self._calls: dict[Future, str] = {}  # native calls running, by target
        self._bad: set[str] = set()  # targets with a call past its deadline still running
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

    def registered(self) -> list[int]:
        """The addresses of the regions registered now."""
        return list(self._registered)

    def unregister(self, address: int) -> None:
        if self._registered.pop(address, None) is not None:
            self._engine.unregister_memory(address)

    def _run(self, write: bool, target: str, local: Sequence[int], remote: Sequence[int],
             lengths: Sequence[int]) -> int:
        local_c, remote_c, len_c = coalesce(local, remote, lengths)
        if not len_c:
            return 0
        start = time.perf_counter()
        total = sum(len_c)
        if self.config.protocol == "tcp" or total >= POLLED_PIECE_BYTES * len(len_c):
            self._polled(write, target, *split(local_c, remote_c, len_c, REQUEST_BYTES))
        else:
            sync = (self._engine.batch_transfer_sync_write if write
                    else self._engine.batch_transfer_sync_read)
            rc = sync(target, local_c, remote_c, len_c)
            if rc != 0:
                raise TransferError(f"{'write' if write else 'read'} to {target} failed "
                                    f"(rc={rc})")
        with self._lock:
            self.bytes_moved += total
            self.seconds_spent += time.perf_counter() - start
        return total

    def _polled(self, write: bool, target: str, local: list[int], remote: list[int],
                lengths: list[int]) -> None:
        """One single-request batch per piece (the engine's status call reads a batch's
        first request only), all submitted, then polled with short pauses until every one
        has ended. The binding's synchronous batch call spins a core until its batch ends,
        which on a busy host starves the engine's own I/O threads and the process's compute
        (2 busy cores, two network namespaces, 64 MiB in 1 MiB pieces: 1.3-1.4 GB/s polled,
        0.8 spinning, at half the CPU; a matmul thread beside a writer of 16 KiB pieces,
        two cores: 12.1 ms a matmul polled, 16.4 spinning, 12.1 alone). Raises
        ``TransferError`` once all submitted requests ended if any failed, or if some still
        run past ``call_timeout_s`` + 1 s per GiB."""
        submit = (self._engine.batch_transfer_async_write if write
                  else self._engine.batch_transfer_async_read)
        op = "write" if write else "read"
        pending: list[int] = []
        failed = 0
        for src, dst, n in zip(local, remote, lengths):
            batch = submit(target, [src], [dst], [n])
            if not 0 < batch < 1 << 63:  # 0 or -1: not submitted (unreachable target)
                failed = len(lengths) - len(pending)
                break
            pending.append(batch)
        give_up = (time.monotonic() + self.config.call_timeout_s
                   + sum(lengths) / BYTES_PER_S_FLOOR)
        pause = POLL_MIN_S
        while pending:
            states = [self._engine.transfer_check_status(b) for b in pending]  # 1 done, 0 not
            failed += sum(1 for st in states if st not in (0, 1))
            pending = [b for b, st in zip(pending, states) if st == 0]
            if pending and time.monotonic() > give_up:
                raise TransferError(f"{op} to {target}: {len(pending)} requests still running "
                                    f"past the engine's deadline")
            if pending:
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX_S)
        if failed:
            raise TransferError(f"{op} to {target}: {failed} of {len(lengths)} requests failed")

    def _submit(self, write: bool, target: str, local: Sequence[int], remote: Sequence[int],
                lengths: Sequence[int]) -> Future:
        """Start one native call on the pool; it is in flight (``in_flight``) until it
        returns, whatever its caller's deadline did meanwhile."""
        with self._lock:
            if target in self._bad:
                raise TransferError(f"{target} is marked bad: a call to it is still hung")
            fut = self._pool.submit(self._run, write, target, local, remote, lengths)
            self._calls[fut] = target
        fut.add_done_callback(self._settled)
        return fut

    def _settled(self, fut: Future) -> None:
        with self._lock:
            target = self._calls.pop(fut, None)
            if target in self._bad and target not in self._calls.values():
                self._bad.discard(target)
                log.warning("%s: its hung transfer returned; usable again", target)

    def _hung(self, target: str, timeout: float) -> TransferError:
        """A call missed its deadline: the peer is bad until its calls return (later
        calls to it fail at once instead of queueing behind it)."""
        with self._lock:
            self._bad.add(target)
        log.warning("transfer to %s missed its %.1fs deadline; marked bad", target, timeout)
        return TransferError(f"transfer to {target} missed its {timeout:.1f}s deadline")

    def in_flight(self, target: Optional[str] = None) -> list[Future]:
        """Native calls still running (to ``target``, or to anyone): memory they write
        must not be reused before they are done, even when their caller gave up."""
        with self._lock:
            return [f for f, t in self._calls.items() if target in (None, t)]

    def _blocking(self, write: bool, target: str, local: Sequence[int],
                  remote: Sequence[int], lengths: Sequence[int],
                  timeout: Optional[float]) -> int:
        timeout = min(timeout, self.config.call_timeout_s) if timeout is not None \
            else self.config.call_timeout_s
        try:
            return self._submit(write, target, local, remote, lengths).result(timeout)
        except FutureTimeout:
            raise self._hung(target, timeout) from None

    def write(self, target: str, local: Sequence[int], remote: Sequence[int],
              lengths: Sequence[int], timeout: Optional[float] = None) -> int:
        """Blocking, at most ``timeout`` (and ``call_timeout_s``): copy local[i] → remote[i]
        on ``target``. Returns bytes moved."""
        return self._blocking(True, target, local, remote, lengths, timeout)

    def read(self, target: str, local: Sequence[int], remote: Sequence[int],
             lengths: Sequence[int], timeout: Optional[float] = None) -> int:
        """Blocking, at most ``timeout`` (and ``call_timeout_s``): copy remote[i] on
        ``target`` → local[i]."""
        return self._blocking(False, target, local, remote, lengths, timeout)

    async def write_async(self, target: str, local: Sequence[int], remote: Sequence[int],
                          lengths: Sequence[int], timeout: float) -> int:
        return await self._await(True, target, local, remote, lengths, timeout)

    async def read_async(self, target: str, local: Sequence[int], remote: Sequence[int],
                         lengths: Sequence[int], timeout: float) -> int:
        return await self._await(False, target, local, remote, lengths, timeout)

    async def _await(self, write: bool, target: str, local: Sequence[int],
                     remote: Sequence[int], lengths: Sequence[int], timeout: float) -> int:
        fut = asyncio.wrap_future(self._submit(write, target, local, remote, lengths))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            # the copy may still end, in error: nobody awaits it now, so retrieve its outcome
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise self._hung(target, timeout) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
