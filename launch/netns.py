"""A multi-host test bed on one machine: network namespaces as hosts, joined by a bridge.

Each "host" is a network namespace with ``lo`` up and one veth leg (``eth0``) on a bridge
that lives in a namespace of its own (``<prefix>-sw``), so every address exists only inside
the bed and the machine's own network is never touched. Processes run on a host through
``ip netns exec``; code of the calling process reaches a host through ``call``, which runs
a function in a fresh thread moved into that host's namespace (sockets it opens stay there).

    from launch.netns import TestBed, available
    ok, why = available()                      # root and iproute2 with netns support?
    with TestBed(3, prefix="cmh", subnet="10.77.0") as bed:
        bed.addresses                          # {"h1": "10.77.0.1", "h2": ..., "h3": ...}
        proc = bed.popen("h2", ["python", "-m", "http.server", "21300"])
        bed.run("h1", ["ping", "-c1", "10.77.0.2"])
        bed.call("h1", urllib.request.urlopen, "http://10.77.0.2:21300/").status

Everything a bed makes is named ``<prefix>-*``; a bed that starts removes what a dead one
of the same prefix left (a SIGKILLed test), and refuses a prefix a live process holds (the
owner's pid is kept in ``/run/crescent-netns/<prefix>.pid``). ``python -m launch.netns
up|down|exec`` does the same from a shell. Two beds at once need different prefixes and
subnets.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
STATE_DIR = Path("/run/crescent-netns")
IP_TIMEOUT_S = 10.0
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,7}$")  # short: interface names stay under 16 bytes


class NetnsError(RuntimeError):
    pass


def ip(*args: str) -> str:
    """Run ``ip ARGS``; a failure raises ``NetnsError`` with ip's own message."""
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True,
                              timeout=IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"ip {' '.join(args)}: {exc}") from None
    if done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def available() -> tuple[bool, str]:
    """Whether network namespaces can be made here, and if not, why not."""
    if shutil.which("ip") is None:
        return False, "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return False, "making network namespaces needs root"
    probe = f"cprobe{os.getpid()}"
    try:  # everything a bed needs: a namespace, a bridge, a veth pair, exec inside
        ip("netns", "add", probe)
        ip("-n", probe, "link", "add", "br0", "type", "bridge")
        ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        ip("netns", "exec", probe, "true")
    except NetnsError as exc:
        return False, f"cannot make a network namespace with a bridge and veths: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True,
                       timeout=IP_TIMEOUT_S)
    return True, ""


def namespaces(prefix: str) -> list[str]:
    """The namespaces named ``<prefix>-*`` that exist now."""
    names = [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(f"{prefix}-"))


def teardown(prefix: str) -> list[str]:
    """Delete every ``<prefix>-*`` namespace (their veths and bridge go with them) and the
    prefix's owner file; returns the namespaces deleted."""
    gone = namespaces(prefix)
    for name in gone:
        ip("netns", "del", name)
    (STATE_DIR / f"{prefix}.pid").unlink(missing_ok=True)
    return gone


class TestBed:
    """``hosts`` namespaces ``<prefix>-h1`` .. named ``h1`` .., with addresses
    ``<subnet>.1`` .. on one /24 bridge. ``start`` builds it, ``close`` removes it."""

    __test__ = False  # not a pytest class

    def __init__(self, hosts: int, prefix: str = "cmh", subnet: str = "10.77.0") -> None:
        if not _PREFIX.match(prefix):
            raise ValueError(f"prefix must be 1-8 lowercase letters or digits starting with "
                             f"a letter, not {prefix!r}")
        if not 1 <= hosts <= 250:
            raise ValueError(f"a bed has 1 to 250 hosts, not {hosts}")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet must be the first three octets (e.g. 10.77.0), "
                             f"not {subnet!r}")
        self.prefix = prefix
        self.switch = f"{prefix}-sw"
        self.addresses = {f"h{i}": f"{subnet}.{i}" for i in range(1, hosts + 1)}

    def netns(self, host: str) -> str:
        """The namespace of ``host`` (``h1`` ..)."""
        if host not in self.addresses:
            raise KeyError(f"no host {host!r} in this bed; one of {sorted(self.addresses)}")
        return f"{self.prefix}-{host}"

    def host_of(self, address: str) -> str:
        """The host that has ``address``."""
        for host, addr in self.addresses.items():
            if addr == address:
                return host
        raise KeyError(f"no host of this bed has address {address!r}")

    # ------------------------------------------------------------- lifecycle
    def start(self) -> "TestBed":
        self._claim()
        try:
            ip("netns", "add", self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for host, address in self.addresses.items():
                ns = self.netns(host)
                ip("netns", "add", ns)
                ip("-n", self.switch, "link", "add", host, "type", "veth",
                   "peer", "name", "eth0", "netns", ns)
                ip("-n", self.switch, "link", "set", host, "master", "br0", "up")
                ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        teardown(self.prefix)

    def _claim(self) -> None:
        """Own the prefix: a live owner is an error; a dead one's leftovers are removed."""
        owner = STATE_DIR / f"{self.prefix}.pid"
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            pid = 0
        if pid and pid != os.getpid() and Path(f"/proc/{pid}").exists():
            raise NetnsError(f"test bed prefix {self.prefix!r} is in use by pid {pid}; "
                             f"pick another prefix (and subnet)")
        teardown(self.prefix)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        owner.write_text(str(os.getpid()))

    def __enter__(self) -> "TestBed":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ processes
    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host`` (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.netns(host), *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(self.argv(host, argv), **kwargs)

    def run(self, host: str, argv: Sequence[str], timeout: float = 30.0,
            **kwargs: Any) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(host, argv), timeout=timeout, **kwargs)

    def call(self, host: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in a new thread inside ``host``'s namespace (a thread's
        network namespace is its own: the caller's stays as it was); returns its result
        or raises its exception."""
        path = f"/run/netns/{self.netns(host)}"
        out: dict[str, Any] = {}

        def inside() -> None:
            try:
                _enter(path)
                out["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller
                out["error"] = exc

        thread = threading.Thread(target=inside, name=f"netns-{host}", daemon=True)
        thread.start()
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["value"]


def _enter(path: str) -> None:
    """Move the calling thread into the network namespace at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.netns",
                                     description="A multi-host test bed of network namespaces.")
    parser.add_argument("--prefix", default="cmh")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build a bed of N hosts (stays until 'down')")
    up.add_argument("hosts", type=int)
    up.add_argument("--subnet", default="10.77.0")
    sub.add_parser("down", help="remove the bed of --prefix (also a dead test's)")
    run = sub.add_parser("exec", help="run a command on one host")
    run.add_argument("host")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            bed = TestBed(args.hosts, args.prefix, args.subnet).start()
            (STATE_DIR / f"{args.prefix}.pid").unlink()  # no live owner: 'down' may remove it
            for host, address in bed.addresses.items():
                print(f"{host} {bed.netns(host)} {address}")
            return 0
        if args.command == "down":
            print("\n".join(teardown(args.prefix)) or "nothing to remove")
            return 0
        return subprocess.call(["ip", "netns", "exec", f"{args.prefix}-{args.host}", *args.cmd])
    except (NetnsError, ValueError) as exc:
        print(f"launch.netns: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
