"""CURVE on real services: a conductor and a store master started as ``python -m
services.X`` with ``[security] curve_key_dir`` admit only peers holding the cluster key.
A plain ZeroMQ peer, or a CURVE peer with a key of its own, gets nothing through (no
reply, no registration) and the service logs it; a keyed peer is served. The store
master's metrics listen on the configured host only."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import zmq
import zmq.asyncio

from common import security
from common.config import ClusterConfig
from common.mailbox import DealerLink, Mailbox
from common.protocol import RegisterWorker
from common.status_protocol import ClusterStatus
from common.security import SecurityConfig, generate_keys
from common.store import protocol as sp
from tests.common.test_security import offer, raw_socket

REPO = Path(__file__).resolve().parents[2]
BASE = 20200  # this file's ports: 20200-20229


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    where = str(tmp_path_factory.mktemp("curve") / "keys")
    generate_keys(where)
    return where


@pytest.fixture
def keyed(key_dir: str) -> Iterator[security.CurveKeys]:
    keys = security.install(SecurityConfig(curve_key_dir=key_dir))
    assert keys is not None
    yield keys
    security.uninstall()


@contextlib.contextmanager
def service(role: str, base: int, key_dir: str, log: Path, ready: str,
            *extra: str) -> Iterator[Path]:
    args = [sys.executable, "-m", f"services.{role}", "--set", f"base_port={base}",
            "--set", f'security.curve_key_dir="{key_dir}"', *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while ready not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(10) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()


def assert_plain_peer_logged(text: str, address: str) -> None:
    """The plain peer's refusal: a mechanism mismatch, or a handshake cut short when the
    peer saw the mismatch first and hung up."""
    assert re.search(re.escape(address) + r": dropped a ZeroMQ peer: (not a CURVE peer of "
                     r"this cluster|handshake failed)", text), text


def assert_listens_on_host_only(port: int, metric: bytes) -> None:
    """``/metrics`` answers on the configured host (127.0.0.1) and nothing listens on
    another local address: bound to ``host``, not to every interface."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert metric in resp.read()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(
            ("127.0.0.2", port), timeout=5):
        pass


def register(instance_id: str) -> RegisterWorker:
    return RegisterWorker(instance_id, "prefill", "tcp://127.0.0.1:1", "127.0.0.1:1", 0,
                          1024, 512, 8, 16)


def test_conductor_registers_only_keyed_workers(keyed: security.CurveKeys, key_dir: str,
                                                tmp_path: Path) -> None:
    config = ClusterConfig(base_port=BASE)

    async def seen(router: Mailbox, seconds: float) -> set[str]:
        """Instances in the conductor's ClusterStatus beats over ``seconds``."""
        ids: set[str] = set()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                msg = await asyncio.wait_for(router.recv(), max(0.01, end - time.monotonic()))
            except asyncio.TimeoutError:
                break
            if isinstance(msg, ClusterStatus):
                ids |= {i.instance_id for i in msg.instances}
        return ids

    async def go() -> tuple[set[str], set[str]]:
        router = Mailbox(config.inbox("router"), "test-router")  # a keyed CURVE server
        workers = Mailbox(None, "test-worker")
        ctx = zmq.asyncio.Context()
        plain = raw_socket(ctx, zmq.PUSH, config.inbox("conductor"))
        stranger = raw_socket(ctx, zmq.PUSH, config.inbox("conductor"), curve=True,
                              server_key=keyed.public)
        try:
            first = await asyncio.wait_for(router.recv(), 10.0)  # the conductor, keyed, beats
            assert isinstance(first, ClusterStatus) and first.instances == []
            await offer(plain, register("prefill-plain"))
            await offer(stranger, register("prefill-stranger"))
            before = await seen(router, 1.5)
            workers.send(config.inbox("conductor"), register("prefill-keyed"))
            after = await seen(router, 1.5)
            return before, after
        finally:
            plain.close()
            stranger.close()
            ctx.term()
            workers.close()
            router.close()

    with service("conductor", BASE, key_dir, tmp_path / "conductor.log", "conductor ready",
                 "--set", "store.enabled=false", "--set", "heartbeat_interval_s=0.1") as log:
        before, after = asyncio.run(go())
        assert_listens_on_host_only(config.port("conductor_http"), b"crescent_conductor")
    assert before == set()
    assert after == {"prefill-keyed"}
    text = log.read_text()
    assert_plain_peer_logged(text, config.inbox("conductor"))
    assert "refused a ZeroMQ peer at 127.0.0.1: CURVE key" in text


def test_store_master_answers_only_keyed_clients(keyed: security.CurveKeys, key_dir: str,
                                                 tmp_path: Path) -> None:
    config = ClusterConfig(base_port=BASE + 10)

    async def go() -> tuple[object, list[int]]:
        ctx = zmq.asyncio.Context()
        strangers = [raw_socket(ctx, zmq.DEALER, config.inbox("store_master")),
                     raw_socket(ctx, zmq.DEALER, config.inbox("store_master"), curve=True,
                                server_key=keyed.public)]
        link = DealerLink(config.inbox("store_master"), "test-client", b"client-1")
        try:
            for sock in strangers:
                await offer(sock, sp.StoreStats(1))
            reply = await link.request(sp.StoreStats(2), 5.0)
            return reply, [await sock.poll(1500) for sock in strangers]
        finally:
            for sock in strangers:
                sock.close()
            ctx.term()
            link.close()

    with service("store_master", BASE + 10, key_dir, tmp_path / "master.log",
                 "store master listening") as log:
        reply, heard = asyncio.run(go())
        assert_listens_on_host_only(config.port("store_master_http"), b"store_objects")
    assert isinstance(reply, sp.StoreStatsReply) and reply.req_id == 2
    assert heard == [0, 0]
    text = log.read_text()
    assert_plain_peer_logged(text, config.inbox("store_master"))
    assert "refused a ZeroMQ peer at 127.0.0.1: CURVE key" in text
