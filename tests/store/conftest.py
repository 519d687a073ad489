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

import pytest

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
        self.spawn("store_master")
        return self.address

    def node(self, name: str, segment_mib: int = 16, shm: bool = True,
             ssd_mib: int = 0, wait: bool = True) -> subprocess.Popen:
        """Start the next node; it registers as ``self.ids[name]``."""
        index = len(self.ids)
        args = ["--index", str(index), "--set", f"store.segment_bytes={segment_mib << 20}",
                "--set", f"store.shm_dir={self.tmp if shm else ''!r}"]
        if ssd_mib:
            args += ["--set", f"store.ssd_dir={self.tmp!r}",
                     "--set", f"store.ssd_bytes={ssd_mib << 20}"]
        proc = self.spawn("store_node", *args)
        if wait:
            wait_for_line(proc, "ready", 20.0)
        self.nodes[name] = proc
        self.ids[name] = f"store_node-{index}"
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


