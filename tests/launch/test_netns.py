"""launch/netns.py: a bed of namespaces that reach each other only over their bridge,
and are gone after close, after a crash, never while another live process owns them."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from launch.netns import STATE_DIR, NetnsError, TestBed, available, namespaces, teardown

OK, WHY = available()
needs_netns = pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}")
PREFIX, SUBNET = "cmhu", "10.79.0"


@pytest.mark.parametrize("args,message", [
    ((3, "Bad"), "prefix must be"), ((3, "toolongprefix"), "prefix must be"),
    ((0,), "1 to 250 hosts"), ((2, "ok", "10.1"), "subnet must be"),
])
def test_bad_beds_are_refused(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        TestBed(*args)


def test_hosts_and_addresses() -> None:
    bed = TestBed(2, PREFIX, SUBNET)
    assert bed.addresses == {"h1": "10.79.0.1", "h2": "10.79.0.2"}
    assert (bed.netns("h2"), bed.host_of("10.79.0.2")) == ("cmhu-h2", "h2")
    assert bed.argv("h1", ["true"]) == ["ip", "netns", "exec", "cmhu-h1", "true"]
    with pytest.raises(KeyError, match="no host 'h3'"):
        bed.netns("h3")
    with pytest.raises(KeyError, match="no host of this bed has address"):
        bed.host_of("127.0.0.1")


def _echo_once(address: str) -> bytes:
    with socket.create_connection((address, 21490), timeout=5) as conn:
        conn.sendall(b"ping")
        return conn.recv(16)


SERVER = ("import socket; s = socket.create_server(('{addr}', 21490)); print('up', flush=True);"
          " c, _ = s.accept(); c.sendall(c.recv(16).upper())")


@needs_netns
def test_hosts_reach_each_other_over_the_bridge_only() -> None:
    with TestBed(2, PREFIX, SUBNET) as bed:
        assert namespaces(PREFIX) == ["cmhu-h1", "cmhu-h2", "cmhu-sw"]
        server = bed.popen("h2", [sys.executable, "-c", SERVER.format(addr="10.79.0.2")],
                           stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "up"
            assert bed.call("h1", _echo_once, "10.79.0.2") == b"PING"
        finally:
            server.kill()
            server.wait(5)
        links = bed.run("h1", ["ip", "-o", "addr", "show"]).stdout
        assert "10.79.0.1/24" in links and "127.0.0.1/8" in links
        # the caller's own namespace has no such address and is unchanged by call()
        assert "10.79.0." not in subprocess.run(["ip", "-o", "addr", "show"],
                                                capture_output=True, text=True).stdout
        with pytest.raises(ConnectionRefusedError):  # h1 loopback is h1's own
            bed.call("h1", socket.create_connection, ("127.0.0.1", 21491), 2)
    assert namespaces(PREFIX) == []


@needs_netns
def test_a_dead_owners_leftovers_are_removed_a_live_owner_is_refused() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    subprocess.run(["ip", "netns", "add", f"{PREFIX}-h7"], check=True)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    (STATE_DIR / f"{PREFIX}.pid").write_text(dead)
    try:
        with TestBed(1, PREFIX, SUBNET):
            assert namespaces(PREFIX) == ["cmhu-h1", "cmhu-sw"]  # h7 of the dead owner: gone
        (STATE_DIR / f"{PREFIX}.pid").write_text(str(os.getppid()))  # alive
        with pytest.raises(NetnsError, match=f"in use by pid {os.getppid()}"):
            TestBed(1, PREFIX, SUBNET).start()
    finally:
        teardown(PREFIX)
    assert namespaces(PREFIX) == [] and not (STATE_DIR / f"{PREFIX}.pid").exists()


def test_unavailable_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert available() == (False, "making network namespaces needs root")
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert available() == (False, "the ip command (iproute2) is not installed")
