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
from typing import Iterator, Optional

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


class Cluster:
    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.nodes: dict[str, subprocess.Popen] = {}
        self.address = ""

    def spawn(self, module: str, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.procs.append(proc)
        return proc

    def master(self, *args: str) -> str:
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.spawn("services.store_master", "--address", self.address,
                   "--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "1.0", *args)
        return self.address

    def node(self, node_id: str, segment_mib: int = 16, shm: bool = True,
             ssd_mib: int = 0, wait: bool = True) -> subprocess.Popen:
        args = ["--master", self.address, "--node-id", node_id,
                "--segment-mib", str(segment_mib), "--shm-dir", self.tmp if shm else ""]
        if ssd_mib:
            args += ["--ssd-dir", os.path.join(self.tmp, f"ssd-{node_id}"),
                     "--ssd-mib", str(ssd_mib)]
        proc = self.spawn("services.store_node", *args)
        if wait:
            wait_for_line(proc, "ready", 20.0)
        self.nodes[node_id] = proc
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


