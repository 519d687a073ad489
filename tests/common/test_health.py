"""common/health.py: the /health port of every process, and its answers."""
from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from common import drain
from common.config import ClusterConfig, HostsConfig, StoreConfig
from common.health import health_port, layout, serve

REPO = Path(__file__).resolve().parents[2]
BASE = 21860  # this module's ports: 21860-21889


def test_off_unless_configured() -> None:
    assert health_port(ClusterConfig(), "router") is None

    async def main() -> None:
        async with serve(ClusterConfig(), "decode", 0) as port:
            assert port is None

    asyncio.run(main())


def test_one_host_every_process_its_own_port() -> None:
    c = ClusterConfig(health_port=BASE, prefill_workers=2, decode_workers=1,
                      colocated_workers=1, store=StoreConfig(nodes=2))
    ports = {proc: health_port(c, *proc) for proc in layout(c)}
    assert ports == {("router", 0): BASE, ("conductor", 0): BASE + 1,
                     ("store_master", 0): BASE + 2, ("prefill", 0): BASE + 3,
                     ("prefill", 1): BASE + 4, ("decode", 0): BASE + 5,
                     ("store_node", 0): BASE + 6, ("store_node", 1): BASE + 7,
                     ("colocated", 0): BASE + 8}


def test_each_address_counts_its_own_processes() -> None:
    """Processes on other hosts do not push a host's ports up; one per pod: all equal."""
    c = ClusterConfig(health_port=BASE, hosts=HostsConfig(prefill=["10.0.0.2"],
                                                          decode=["10.0.0.2"]))
    assert [health_port(c, *proc) for proc in layout(c)] == \
        [BASE, BASE + 1, BASE + 2, BASE, BASE + 1, BASE + 3, BASE + 4]
    k8s = ClusterConfig.load(str(REPO / "launch" / "configs" / "k8s.toml"))
    assert {health_port(k8s, *proc) for proc in layout(k8s)} == {k8s.health_port}


def test_unknown_process_is_an_error() -> None:
    with pytest.raises(ValueError, match="decode-3"):
        health_port(ClusterConfig(health_port=BASE), "decode", 3)


def test_answers_ok_then_unavailable_while_draining() -> None:
    config = ClusterConfig(health_port=BASE + 10)

    async def main() -> None:
        async with serve(config, "prefill", 0) as port, httpx.AsyncClient() as http:
            url = f"http://127.0.0.1:{port}/health"
            ok = await http.get(url, timeout=5)
            assert ok.status_code == 200
            assert ok.json() == {"status": "ok", "role": "prefill", "index": 0,
                                 "pid": ok.json()["pid"]}
            process_drain = drain.install(timeout_s=5.0)
            process_drain.until(lambda: False)  # in-flight work: the drain stays active
            main_task = asyncio.ensure_future(asyncio.sleep(10))
            try:
                process_drain.begin(main_task)
                busy = await http.get(url, timeout=5)
                assert busy.status_code == 503 and busy.json()["reason"] == "shutting down"
            finally:
                main_task.cancel()
                drain.install(timeout_s=10.0)
        with pytest.raises(httpx.ConnectError):  # the listener closed with the block
            httpx.get(url, timeout=2)

    asyncio.run(main())


def start(role: str, *settings: str) -> subprocess.Popen:
    args = ["--set", f"base_port={BASE + 20}", "--set", f"health_port={BASE + 15}",
            *[x for s in settings for x in ("--set", s)]]
    return subprocess.Popen([sys.executable, "-m", f"services.{role}", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.e2e
def test_a_real_service_answers_and_stops_cleanly() -> None:
    """The bootstrap serves /health around a real store master until SIGTERM."""
    proc = start("store_master")
    url = f"http://127.0.0.1:{BASE + 15 + 2}/health"  # the master is third in the layout
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                answer = httpx.get(url, timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                time.sleep(0.1)
        assert answer.status_code == 200 and answer.json()["role"] == "store_master"
        assert answer.json()["pid"] == proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.e2e
def test_a_taken_health_port_fails_the_start_with_one_line() -> None:
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", BASE + 15 + 2))
        taken.listen()
        proc = start("store_master")
        try:
            out, _ = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 1, out
    assert "could not start" in out and "Traceback" not in out
