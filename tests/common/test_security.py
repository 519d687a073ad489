"""CURVE on every socket of the one factory (common/security.py, common/ipc.py): keyed
peers talk, peers without the cluster key get nothing through and are logged; the keys
``crescent keygen`` writes; the ``[security]`` table."""
from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import zmq
import zmq.asyncio

from common import security
from common.config import ClusterConfig
from common.ipc import encode
from common.mailbox import DealerLink, Mailbox, RouterInbox
from common.protocol import AbortRequest
from common.security import SecurityConfig, generate_keys, key_paths, load_keys
from common.store import protocol as sp
from launch.cli import main as crescent

PORT = 20290  # this file's ports: 20290-20299


@pytest.fixture
def keys(tmp_path: Path) -> Iterator[security.CurveKeys]:
    generate_keys(str(tmp_path / "keys"))
    installed = security.install(SecurityConfig(curve_key_dir=str(tmp_path / "keys")))
    security._THROTTLE._last.clear()
    assert installed is not None
    yield installed
    security.uninstall()


def raw_socket(ctx: zmq.asyncio.Context, kind: int, address: str,
               curve: bool = False, server_key: bytes = b"") -> zmq.asyncio.Socket:
    """A peer that does not use the factory: plain, or CURVE with a keypair of its own."""
    sock = ctx.socket(kind)
    sock.linger = 0
    if curve:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = server_key
    sock.connect(address)
    return sock


async def offer(sock: zmq.asyncio.Socket, msg: object) -> None:
    """Send as a stranger would; a refused peer may have no pipe to queue on (a PUSH or
    DEALER then blocks), which is nothing getting through as well."""
    try:
        await asyncio.wait_for(sock.send(encode(msg)), 1.0)
    except asyncio.TimeoutError:
        pass


async def received(mailbox: Mailbox, timeout_s: float) -> list[str]:
    out = []
    while True:
        try:
            msg = await asyncio.wait_for(mailbox.recv(), timeout_s)
        except asyncio.TimeoutError:
            return out
        out.append(msg.request_id)


def test_only_keyed_peers_reach_a_mailbox(keys: security.CurveKeys,
                                          caplog: pytest.LogCaptureFixture) -> None:
    address = f"tcp://127.0.0.1:{PORT}"

    async def go() -> list[str]:
        server, client = Mailbox(address, "server"), Mailbox(None, "client")
        ctx = zmq.asyncio.Context()
        plain = raw_socket(ctx, zmq.PUSH, address)
        stranger = raw_socket(ctx, zmq.PUSH, address, curve=True, server_key=keys.public)
        try:
            await offer(plain, AbortRequest("plain"))
            await offer(stranger, AbortRequest("stranger"))
            client.send(address, AbortRequest("keyed"))
            return await received(server, 1.5)
        finally:
            plain.close()
            stranger.close()
            ctx.term()
            server.close()
            client.close()

    with caplog.at_level(logging.WARNING, logger="common.security"):
        assert asyncio.run(go()) == ["keyed"]
    lines = [r.getMessage() for r in caplog.records]
    # the plain peer: a mechanism mismatch, or a handshake cut short when it saw the
    # mismatch first and hung up
    assert any(m.startswith(f"{address}: dropped a ZeroMQ peer: ") for m in lines), lines
    assert any("refused a ZeroMQ peer at 127.0.0.1: CURVE key" in m and
               "is not the cluster's" in m for m in lines)


def test_router_inbox_answers_only_keyed_dealers(keys: security.CurveKeys) -> None:
    address = f"tcp://127.0.0.1:{PORT + 1}"

    async def go() -> tuple[object, bool, bool]:
        inbox = RouterInbox(address, "master")
        link = DealerLink(address, "node", b"node-0")
        ctx = zmq.asyncio.Context()
        strangers = [raw_socket(ctx, zmq.DEALER, address),
                     raw_socket(ctx, zmq.DEALER, address, curve=True, server_key=keys.public)]

        async def echo() -> None:
            while True:
                sender, msg = await inbox.next()
                inbox.reply(sender, sp.StoreRemoveReply(msg.req_id, 0))

        task = asyncio.create_task(echo())
        try:
            for sock in strangers:
                await offer(sock, sp.StoreRemove(1, ["00"]))
            reply = await link.request(sp.StoreRemove(2, ["00"]), 3.0)
            heard = [await sock.poll(1000) for sock in strangers]
            return reply, heard[0], heard[1]
        finally:
            task.cancel()
            for sock in strangers:
                sock.close()
            ctx.term()
            link.close()
            inbox.close()

    assert asyncio.run(go()) == (sp.StoreRemoveReply(2, 0), 0, 0)


def test_without_a_key_sockets_stay_plain() -> None:
    security.uninstall()
    address = f"tcp://127.0.0.1:{PORT + 2}"

    async def go() -> list[str]:
        server = Mailbox(address, "server")
        ctx = zmq.asyncio.Context()
        plain = raw_socket(ctx, zmq.PUSH, address)
        try:
            await plain.send(encode(AbortRequest("plain")))
            return await received(server, 0.5)
        finally:
            plain.close()
            ctx.term()
            server.close()

    assert asyncio.run(go()) == ["plain"]


def test_keygen_writes_a_private_pair_once(tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    where = str(tmp_path / "k")
    assert crescent(["keygen", where]) == 0
    public_file, secret_file = key_paths(where)
    first = load_keys(where)
    assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o700
    assert public_file.read_text().count(first.public.decode()) == 1
    assert secret_file.read_text().count(first.secret.decode()) == 1
    assert public_file.read_text().count(first.secret.decode()) == 0  # public half only
    assert crescent(["keygen", where]) == 0  # idempotent: the pair is kept
    assert load_keys(where) == first
    assert "kept the existing" in capsys.readouterr().out
    assert crescent(["keygen", where, "--force"]) == 0
    assert load_keys(where) != first
    secret_file.write_text("not a certificate\n")
    assert crescent(["keygen", where]) == 1  # a broken pair is an error, never kept


def test_unusable_key_dirs_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no .*cluster.key_secret .*crescent keygen"):
        load_keys(str(tmp_path))
    generate_keys(str(tmp_path))
    key_paths(str(tmp_path))[1].write_text("metadata\ncurve\n    public-key = \"x\"\n")
    with pytest.raises(ValueError, match="holds no CURVE keypair|cannot read"):
        load_keys(str(tmp_path))


def test_security_table(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[security]\ncurve_key_dir = "/keys"\napi_keys = ["a", "b"]\n')
    config = ClusterConfig.load(str(path))
    assert config.security == SecurityConfig("/keys", ["a", "b"], None)
    assert ClusterConfig().security == SecurityConfig()  # off by default
    with pytest.raises(ValueError, match=r"in \[security\]: \['curve_key'\]"):
        ClusterConfig.from_dict({"security": {"curve_key": "x"}})


def test_a_missing_key_stops_a_service_as_a_bad_config(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "services.conductor", "--set",
                          f'security.curve_key_dir="{tmp_path / "none"}"'], cwd=repo,
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(repo)))
    assert out.returncode == 2
    assert "bad config: security.curve_key_dir: no " in out.stderr
    assert "crescent keygen" in out.stderr


def test_refusal_log_is_throttled_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    throttle = security._Throttle(period_s=60.0, max_keys=3)
    with caplog.at_level(logging.WARNING, logger="common.security"):
        for _ in range(5):
            throttle.warn("peer-a", "refused %s", "a")
        for peer in ("b", "c", "d", "e"):
            throttle.warn(f"peer-{peer}", "refused %s", peer)
    assert [r.getMessage() for r in caplog.records] == [
        "refused a", "refused b", "refused c"]  # d, e: over max_keys within one period
    assert len(throttle._last) == 3 and throttle._last["peer-a"][1] == 4  # 4 held back
