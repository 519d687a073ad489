"""Fixtures: one router subprocess and one scripted fake cluster for the whole directory."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from common.config import ClusterConfig
from tests.router.fake_cluster import READY, FakeCluster, default_script

REPO = Path(__file__).resolve().parents[2]
REQUEST_TIMEOUT_S = 1.5
HEARTBEAT_S = 0.2
CONDUCTOR_TIMEOUT_S = 0.8  # the router gives up on a silent conductor after this


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _pick_ports() -> tuple[int, int]:
    """(http_port, base_port): the HTTP port and the router/conductor inbox ports free.
    Drawn above the other modules' fixed ports (19400-25000), which a module running at
    the same time on another xdist worker binds later, and below the kernel's ephemeral
    range (32768 and up), from this xdist worker's own slice of that range: two workers'
    draws could otherwise meet, one's HTTP port the other's inbox, free when each checked
    and bound by the other first (a fresh clone's run lost 38 tests to that)."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    span = (32000 - 28000) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    first = 28000 + worker * span
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(200):
        base = rng.randrange(first + 100, first + span - 2, 10)
        http = base - 100
        if all(_free(p) for p in (http, base, base + 1, base + 2)):
            return http, base
    raise RuntimeError("no free ports")


@pytest.fixture(scope="session")
def router_config(tmp_path_factory: pytest.TempPathFactory) -> tuple[ClusterConfig, Path]:
    http, base = _pick_ports()
    path = tmp_path_factory.mktemp("router") / "cluster.toml"
    path.write_text(f"http_port = {http}\nbase_port = {base}\n"
                    f"request_timeout_s = {REQUEST_TIMEOUT_S}\n"
                    f"heartbeat_interval_s = {HEARTBEAT_S}\ndefault_max_tokens = 64\n"
                    f"heartbeat_timeout_s = {CONDUCTOR_TIMEOUT_S}\n")
    return ClusterConfig.load(str(path)), path


@pytest.fixture(scope="session")
def fake(router_config: tuple[ClusterConfig, Path]) -> Iterator[FakeCluster]:
    cluster = FakeCluster(router_config[0])
    cluster.start()
    yield cluster
    cluster.stop()


def _wait_listening(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited {proc.returncode}:\n{log.read_text()}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=1.0).close()
            return
        except urllib.error.HTTPError:  # an answer all the same (401 with API keys on)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"router did not start in {timeout} s:\n{log.read_text()}")


@contextlib.contextmanager
def router_process(config: ClusterConfig, path: Path, log: Path) -> Iterator[str]:
    """A router subprocess on ``path``'s config: its base URL until the block ends."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                         os.environ.get("PYTHONPATH")])))
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.router", "--config",
                                 str(path)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO, start_new_session=True)
    url = f"http://{config.host}:{config.http_port}"
    try:
        _wait_listening(proc, url, log, timeout=120)  # first run converts the tokenizer
        assert "router ready on " + url in log.read_text()
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def own_router(tmp: Path, settings: str) -> Iterator[tuple[str, FakeCluster]]:
    """A router subprocess on a config of its own (fresh ports, then ``settings``: TOML
    lines) behind a fake cluster of its own: (its base URL, the fake) until the block
    ends."""
    http, base = _pick_ports()
    path = tmp / "cluster.toml"
    path.write_text(f"http_port = {http}\nbase_port = {base}\n{settings}")
    config = ClusterConfig.load(str(path))
    fake = FakeCluster(config)
    fake.start()
    try:
        with router_process(config, path, tmp / "router.log") as url:
            yield url, fake
    finally:
        fake.stop()


@pytest.fixture(scope="session")
def router(router_config: tuple[ClusterConfig, Path], fake: FakeCluster,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a router subprocess wired to the fake cluster."""
    config, path = router_config
    with router_process(config, path, tmp_path_factory.mktemp("router-log") / "router.log") \
            as url:
        yield url


@pytest.fixture(autouse=True)
def _reset_fake(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "fake" in request.fixturenames:
        cluster = request.getfixturevalue("fake")
        cluster.script = default_script
        if cluster.status is not READY:  # the next test starts with a live conductor
            cluster.status = READY
            time.sleep(3 * cluster.status_interval_s)
