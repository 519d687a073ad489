"""Real store processes for tests: started per test, always killed in teardown."""
from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import numpy as np
import pytest

from common.store.client import StoreClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            if text in line:
                return
            if not line and proc.poll() is not None:
                break
    raise AssertionError(f"process did not print {text!r} within {timeout}s")


def free_base_port() -> int:
    """A base port whose store ports (master +2, metrics +4, events +5) are free."""
    for _ in range(50):
        base = free_port()
        try:
            for offset in (2, 4, 5):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
    raise RuntimeError("no free base port")


class Cluster:
    """One store master and its nodes, each started like in a cluster: ``python -m
    services.<role> --config FILE --index I --set ...`` (common/service.py)."""

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.nodes: dict[str, subprocess.Popen] = {}
        self.ids: dict[str, str] = {}  # test name → node id
        self.args: dict[str, list[str]] = {}  # test name → its node's arguments
        self.master_proc: subprocess.Popen | None = None
        self.address = ""
        self.config = os.path.join(tmp, "cluster.toml")

    def spawn(self, role: str, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", f"services.{role}", "--config",
                                 self.config, *args], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        self.procs.append(proc)
        return proc

    def master(self, **policy: float) -> str:
        """Start the master; ``policy``: fields of ``[store.policy]``."""
        base = free_base_port()
        lines = [f"base_port = {base}", "[store]", "heartbeat_interval_s = 0.2",
                 "[store.policy]", "heartbeat_timeout_s = 1.0"]
        lines += [f"{k} = {v}" for k, v in policy.items()]
        with open(self.config, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        self.address = f"tcp://127.0.0.1:{base + 2}"
        self.master_proc = self.spawn("store_master")
        return self.address

    def kill_master(self) -> None:
        """SIGKILL the master (no chance to clean up)."""
        assert self.master_proc is not None
        self.master_proc.kill()
        self.master_proc.wait(5)

    def restart_master(self) -> None:
        """SIGKILL the master and start it again on the same ports, empty."""
        self.kill_master()
        self.master_proc = self.spawn("store_master")

    def node(self, name: str, segment_mib: int = 16, shm: bool = True,
             ssd_mib: int = 0, wait: bool = True) -> subprocess.Popen:
        """Start the next node; it registers as ``self.ids[name]``."""
        index = len(self.ids)
        args = ["--index", str(index), "--set", f"store.segment_bytes={segment_mib << 20}",
                "--set", f"store.shm_dir={self.tmp if shm else ''!r}"]
        if ssd_mib:
            args += ["--set", f"store.ssd_dir={self.tmp!r}",
                     "--set", f"store.ssd_bytes={ssd_mib << 20}"]
        self.args[name] = args
        self.ids[name] = f"store_node-{index}"
        return self._start_node(name, wait)

    def restart_node(self, name: str, wait: bool = True) -> subprocess.Popen:
        """SIGKILL node ``name`` if it runs, then start it again with the same index."""
        old = self.nodes[name]
        if old.poll() is None:
            old.kill()
            old.wait(5)
        return self._start_node(name, wait)

    def _start_node(self, name: str, wait: bool) -> subprocess.Popen:
        proc = self.spawn("store_node", *self.args[name])
        if wait:
            wait_for_line(proc, "ready", 20.0)
        self.nodes[name] = proc
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    tmp = tempfile.mkdtemp(prefix="crescent-store-test-", dir="/dev/shm")
    c = Cluster(tmp)
    try:
        yield c
    finally:
        c.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def transfer():
    from common.transfer import TransferAgent, TransferConfig

    agent = TransferAgent(TransferConfig())
    yield agent
    agent.close()


BLOCK = 256 << 10
SLOTS = 64  # blocks in each test buffer


@pytest.fixture(scope="session")
def buffers(transfer):
    """A source with random blocks and a destination, registered once for the session."""
    src = np.random.default_rng(0).integers(0, 256, SLOTS * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    transfer.register(src.ctypes.data, src.nbytes)
    transfer.register(dst.ctypes.data, dst.nbytes)
    return src, dst


def addrs(arr: np.ndarray, idx: range | list[int]) -> list[int]:
    return [arr.ctypes.data + i * BLOCK for i in idx]


def same(src: np.ndarray, dst: np.ndarray, i: int, j: int) -> bool:
    return bool((src[i * BLOCK:(i + 1) * BLOCK] == dst[j * BLOCK:(j + 1) * BLOCK]).all())


def keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


async def client_for(address: str, transfer, use_shm: bool, shm_dir: str) -> StoreClient:
    """A client of the master at ``address``; it maps node segments in ``shm_dir`` only."""
    c = StoreClient(address, transfer, timeout_s=3.0, use_shm=use_shm, shm_dir=shm_dir)
    await c.start()
    return c
