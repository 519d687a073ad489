"""The store benchmark's clients, ours and Mooncake Store's, one round at a time.

A round is one batch put then one batch get of ``TOTAL`` bytes of ``size``-byte values from
and into registered buffers, the bytes checked afterwards (outside the timings). A client
runs in a process of its own (``benchmarks/store.py --phase ours-client`` /
``ours-tcp-client`` / ``mooncake-client``: Mooncake's client and our transfer engine each
want the process to themselves, and across hosts the client lives in another network
namespace), driven over its stdin and stdout one line per round (``ClientProc``), so that
a driver can interleave the rounds of the stores (``interleave``) and the machine's noise
falls on all alike.
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, NoReturn, Protocol

import numpy as np

TOTAL = 64 << 20  # bytes per batch
LEASE_S = 2.0  # the benchmark master's read lease (default 5 s); a get must end within it
PENDING = 4  # batches read but not yet removed (each waits for its lease to lapse)
REPLY_S = 120.0  # a client answers a round (or its final report) within this


class Client(Protocol):
    def round(self, size: int) -> tuple[float, float]: ...  # seconds: batch put, batch get

    def report(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def buffers() -> tuple[np.ndarray, np.ndarray]:
    src = np.random.default_rng(1).integers(0, 256, TOTAL, dtype=np.uint8)
    dst = np.ones(TOTAL, dtype=np.uint8)  # touched: no page faults inside timings
    return src, dst


def slots(src: np.ndarray, dst: np.ndarray, size: int) -> tuple[int, list[int], list[int]]:
    """How many objects of ``size`` fill the buffers, and their source/destination addresses."""
    n = TOTAL // size
    return (n, [src.ctypes.data + i * size for i in range(n)],
            [dst.ctypes.data + i * size for i in range(n)])


def gbps(seconds: list[float]) -> float:
    return TOTAL / statistics.median(seconds) / 1e9


def _check(src: np.ndarray, dst: np.ndarray, who: str) -> None:
    if not (src == dst).all():
        raise RuntimeError(f"{who}: the bytes got differ from the bytes put")
    dst[:] = 1


class OursClient:
    """A ``StoreClient`` with its own transfer engine; ``use_shm=False`` forces the engine
    even where the node's segment file could be mapped."""

    def __init__(self, address: str, hostname: str, use_shm: bool, shm_dir: str) -> None:
        from common.store.client import StoreClient
        from common.transfer import TransferAgent, TransferConfig

        self.runner = asyncio.Runner()  # one loop for every round: the client's tasks live on
        self.transfer = TransferAgent(TransferConfig(hostname=hostname))
        self.client = StoreClient(address, self.transfer, timeout_s=30.0, use_shm=use_shm,
                                  shm_dir=shm_dir)
        self.runner.run(self.client.start())
        self.src, self.dst = buffers()
        self.client.register_local(self.src.ctypes.data, TOTAL)
        self.client.register_local(self.dst.ctypes.data, TOTAL)
        self.pending: collections.deque[tuple[float, list[bytes]]] = collections.deque()

    def round(self, size: int) -> tuple[float, float]:
        return self.runner.run(self._round(size))

    async def _round(self, size: int) -> tuple[float, float]:
        await self._remove(PENDING - 1)
        n, addr_s, addr_d = slots(self.src, self.dst, size)
        keys = [os.urandom(16) for _ in range(n)]
        t0 = time.perf_counter()
        stored = await self.client.batch_put_from(keys, addr_s, size)
        t1 = time.perf_counter()
        got = await self.client.batch_get_into(keys, addr_d, size)
        t2 = time.perf_counter()
        if stored != n or not all(got):
            raise RuntimeError(f"ours: stored {stored} and got {sum(got)} of {n} objects")
        _check(self.src, self.dst, "ours")
        self.pending.append((time.monotonic() + LEASE_S, keys))
        return t1 - t0, t2 - t1

    async def _remove(self, keep: int) -> None:
        """Remove the batches whose lease has lapsed, and wait for the oldest ones' until
        at most ``keep`` remain (the segment holds them all; eviction never has to run)."""
        while self.pending and (len(self.pending) > keep
                                or self.pending[0][0] <= time.monotonic()):
            lapses, keys = self.pending.popleft()
            await asyncio.sleep(max(0.0, lapses - time.monotonic()) + 0.05)
            if await self.client.remove(keys) != len(keys):
                raise RuntimeError("ours: remove failed")

    def report(self) -> dict[str, Any]:
        """What the transfer engine moved, and the node segments mapped here (shm path)."""
        return {"engine_bytes": self.transfer.bytes_moved,
                "mapped": self.client.mapped_segments()}

    def close(self) -> None:
        self.runner.run(self.client.close())
        self.transfer.close()
        self.runner.close()


def mooncake_store(segment: int, master: str, hostname: str) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(hostname, "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"mooncake setup failed rc={rc}")
    return store


class MooncakeClient:
    """A pure Mooncake Store client (no segment of its own) with registered buffers."""

    def __init__(self, master: str, hostname: str) -> None:
        self.store = mooncake_store(0, master, hostname)
        self.src, self.dst = buffers()
        for buf in (self.src, self.dst):
            if self.store.register_buffer(buf.ctypes.data, TOTAL) != 0:
                raise RuntimeError("mooncake register_buffer failed")

    def round(self, size: int) -> tuple[float, float]:
        n, addr_s, addr_d = slots(self.src, self.dst, size)
        keys = [os.urandom(16).hex() for _ in range(n)]
        t0 = time.perf_counter()
        rcs = self.store.batch_put_from(keys, addr_s, [size] * n)
        t1 = time.perf_counter()
        got = self.store.batch_get_into(keys, addr_d, [size] * n)
        t2 = time.perf_counter()
        if any(x != 0 for x in rcs) or any(x != size for x in got):
            raise RuntimeError(f"mooncake: put {rcs[:4]}..., got {got[:4]}...")
        _check(self.src, self.dst, "mooncake")
        self.store.remove_all(True)
        return t1 - t0, t2 - t1

    def report(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.store.close()


def nic_bytes() -> tuple[int, int]:
    """(received, sent) bytes over every interface but loopback of this network namespace."""
    rx = tx = 0
    with open("/proc/net/dev") as fh:
        for line in fh.readlines()[2:]:
            name, fields = line.split(":", 1)
            if name.strip() != "lo":
                rx, tx = rx + int(fields.split()[0]), tx + int(fields.split()[8])
    return rx, tx


def serve(client: Client) -> None:
    """The client process's loop: a value size per stdin line → one round, its times as a
    JSON line; at end of input, the client's report and the bytes this namespace's
    interfaces received and sent meanwhile."""
    before = nic_bytes()
    for line in sys.stdin:
        put, get = client.round(int(line))
        print(json.dumps({"put": put, "get": get}), flush=True)
    after = nic_bytes()
    report = {**client.report(), "nic_bytes": [a - b for a, b in zip(after, before)]}
    client.close()
    print(json.dumps(report), flush=True)


Times = list[tuple[float, float]]  # per round: seconds of the batch put, of the batch get


def interleave(clients: dict[str, "ClientProc"], size: int, rounds: int) -> dict[str, Times]:
    """Each client's round times with ``size``-byte values: one warm-up round each, then
    ``rounds`` rounds each, the clients taking turns (the order reverses every turn, so no
    client always follows the same one)."""
    for client in clients.values():
        client.round(size)
    names = list(clients)
    times: dict[str, Times] = {name: [] for name in names}
    for k in range(rounds):
        for name in (names if k % 2 == 0 else names[::-1]):
            times[name].append(clients[name].round(size))
    return times


def rates(times: Times) -> tuple[float, float]:
    """(put GB/s, get GB/s): the medians of the rounds."""
    return gbps([t[0] for t in times]), gbps([t[1] for t in times])


class ClientProc:
    """A client process (``argv``: its ``--phase *-client`` command) driven round by round;
    every answer has a deadline, and a dead or silent client raises with its stderr. Its
    stdout is read unbuffered and split here, so a line that arrives together with another
    is never left in a buffer that ``select`` cannot see."""

    def __init__(self, argv: list[str]) -> None:
        self.name = argv[argv.index("--phase") + 1]
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, bufsize=0)
        assert self.proc.stdout is not None
        self.out = self.proc.stdout.fileno()
        self.pending = b""  # read, not yet split into lines
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.out, selectors.EVENT_READ)

    def round(self, size: int) -> tuple[float, float]:
        self._send(f"{size}\n".encode())
        reply = self._reply()
        return reply["put"], reply["get"]

    def finish(self) -> dict[str, Any]:
        """End the client; its report."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        report = self._reply()
        self.proc.wait(REPLY_S)
        return report

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.sel.close()
        self.err.close()

    def _send(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line)
        except BrokenPipeError:
            self._fail("exited")

    def _reply(self) -> dict[str, Any]:
        """The client's next JSON line (other output skipped) within ``REPLY_S``."""
        deadline = time.monotonic() + REPLY_S
        while True:
            while b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                if line.startswith(b"{"):
                    return json.loads(line)
            left = deadline - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                self._fail(f"did not answer within {REPLY_S:.0f}s")
            chunk = os.read(self.out, 1 << 16)
            if not chunk:
                self._fail("exited")
            self.pending += chunk

    def _fail(self, what: str) -> NoReturn:
        self.proc.kill()
        self.proc.wait(10)
        self.err.seek(0)
        raise RuntimeError(f"{self.name} {what}: {self.err.read()[-2000:]}")
