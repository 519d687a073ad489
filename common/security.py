"""A closed control plane: CURVE on every ZeroMQ socket, clamped deadlines, checked paths.

CURVE (``[security] curve_key_dir``): the cluster has one keypair, made by ``crescent
keygen DIR`` and readable by every process of the cluster. ``install`` (called by the
bootstrap) loads it; from then on ``secure`` (called by the one socket factory,
common/ipc.py) makes every bound socket a CURVE server and every connecting socket a CURVE
client that presents the cluster key. A server admits only a peer whose public key *is*
the cluster's: proving it takes the cluster's secret key (the CURVE handshake). The check
runs in pyzmq's ZAP handler, one per ZeroMQ context, started with the context's first
server socket. It is pyzmq's ``ThreadAuthenticator``: it answers handshakes while the
event loop runs a model step, and it does not depend on which asyncio loop runs. Refused
peers — a wrong key (ZAP) or no CURVE at all (a handshake failure on the socket's monitor)
— are dropped by ZeroMQ before any frame reaches a service, and logged, at most once a
second per socket and kind of refusal. No key configured: every socket stays plain, as before.

Out of scope: the transfer engine (Mooncake's own listener; keep it on a private network)
and the HTTP listeners (the router's API keys: services/router/auth.py).

Also here, for every receiver: ``clamp_deadline`` (a sender-chosen deadline never reaches
past the receiver's own maximum) and ``checked_shm_path`` (a file a peer names is mapped
only if it is a regular file of ours).
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

KEY_NAME = "cluster"  # DIR/cluster.key (public), DIR/cluster.key_secret (both halves)
ZAP_DOMAIN = "crescent"
_HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
                     zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "not a CURVE peer of this cluster",
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key refused"}


@dataclass
class SecurityConfig:
    """The ``[security]`` table (README.md, docs/security.md)."""

    curve_key_dir: Optional[str] = None  # a `crescent keygen DIR` keypair: CURVE everywhere
    api_keys: list[str] = field(default_factory=list)  # router: /v1/* needs one as Bearer
    api_key_file: Optional[str] = None  # the same, one key per line (# comments)

    def __post_init__(self) -> None:
        if not isinstance(self.api_keys, list) or not all(
                isinstance(k, str) and k.strip() for k in self.api_keys):
            raise ValueError("security.api_keys must be a list of non-empty strings")


@dataclass(frozen=True)
class CurveKeys:
    public: bytes  # Z85, 40 bytes
    secret: bytes


# ------------------------------------------------------------------ keys


def key_paths(directory: str) -> tuple[Path, Path]:
    base = Path(directory) / KEY_NAME
    return base.with_suffix(".key"), base.with_suffix(".key_secret")


def generate_keys(directory: str, force: bool = False) -> tuple[Path, bool]:
    """The cluster keypair in ``directory`` (created 0700, the secret 0600): (secret file,
    whether it was made now). An existing valid pair is kept unless ``force``."""
    public, secret = key_paths(directory)
    if secret.exists() and not force:
        load_keys(directory)  # an unreadable or broken pair is an error, not kept
        return secret, False
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for path in (public, secret):
        path.unlink(missing_ok=True)
    zmq.auth.create_certificates(directory, KEY_NAME)
    os.chmod(secret, 0o600)
    return secret, True


def load_keys(directory: str) -> CurveKeys:
    """The keypair ``crescent keygen`` wrote in ``directory``; ValueError if unusable."""
    _, secret_file = key_paths(directory)
    if not secret_file.is_file():
        raise ValueError(f"security.curve_key_dir: no {secret_file} "
                         f"(make one with `crescent keygen {directory}`)")
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"security.curve_key_dir: cannot read {secret_file}: {exc}") from None
    if not secret or len(public) != 40 or len(secret) != 40:
        raise ValueError(f"security.curve_key_dir: {secret_file} holds no CURVE keypair")
    if secret_file.stat().st_mode & 0o077:
        log.warning("%s is readable by other users (chmod 600 it)", secret_file)
    return CurveKeys(public, secret)


# ------------------------------------------------------------------ CURVE


class _Throttle:
    """At most one log line per ``period_s`` per key; the count of those held back. Keys
    (peer addresses) are bounded: past ``max_keys`` the quiet ones are forgotten."""

    def __init__(self, period_s: float = 1.0, max_keys: int = 1024) -> None:
        self.period_s = period_s
        self.max_keys = max_keys
        self._last: dict[str, tuple[float, int]] = {}

    def warn(self, key: str, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if key not in self._last and len(self._last) >= self.max_keys:
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.period_s}
            if len(self._last) >= self.max_keys:
                return  # a flood from more peers than that in one period: counted by none
        last, held = self._last.get(key, (-1e9, 0))
        if now - last < self.period_s:
            self._last[key] = (last, held + 1)
            return
        self._last[key] = (now, 0)
        suffix = f" (+{held} more since the last line)" if held else ""
        log.warning(fmt + "%s", *args, suffix)


_THROTTLE = _Throttle()


class _ClusterAuthenticator(ThreadAuthenticator):
    """ZAP: admit only the installed cluster key; log each refusal with the peer address.
    It lives as long as its context (a ZAP endpoint cannot be re-bound at once)."""

    def __init__(self, context: zmq.Context) -> None:
        super().__init__(context)
        self._peer = "?"

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # RFC 27: version, request id, domain, address, identity, mechanism, credentials
        self._peer = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, client_key: bytes) -> bool:  # the credentials provider
        keys = _KEYS
        if keys is not None and hmac.compare_digest(client_key, keys.public):
            return True
        _THROTTLE.warn(f"zap:{self._peer}", "refused a ZeroMQ peer at %s: CURVE key %s is "
                       "not the cluster's; its frames are dropped", self._peer,
                       client_key.decode("ascii", "replace"))
        return False


_KEYS: Optional[CurveKeys] = None
_AUTHS: dict[int, _ClusterAuthenticator] = {}  # id(context) → its ZAP handler
_MONITORS: set[asyncio.Task] = set()
_IDS = itertools.count()


def install(config: SecurityConfig) -> Optional[CurveKeys]:
    """Load the cluster key (if configured) for every socket made from now on."""
    global _KEYS
    _KEYS = load_keys(config.curve_key_dir) if config.curve_key_dir else None
    if _KEYS is not None:
        log.info("CURVE on: every ZeroMQ peer must hold the cluster key %s",
                 _KEYS.public.decode())
    return _KEYS


def uninstall() -> None:
    """Plain sockets from now on (tests). Running ZAP handlers then refuse every key."""
    global _KEYS
    _KEYS = None


def installed() -> Optional[CurveKeys]:
    return _KEYS


def _authenticator(ctx: zmq.Context) -> None:
    auth = _AUTHS.get(id(ctx))
    if auth is not None and auth.context is ctx and auth.is_alive():
        return
    auth = _ClusterAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=auth)
    _AUTHS[id(ctx)] = auth


def secure(ctx: zmq.Context, sock: zmq.Socket, bind: bool, address: str) -> None:
    """Make ``sock`` (not yet bound or connected) a CURVE server or client of the cluster
    key; nothing when no key is installed. The socket factory's one hook."""
    keys = _KEYS
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    if not bind:
        sock.curve_serverkey = keys.public
        return
    _authenticator(ctx)
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    _watch_handshakes(sock, address)


def _watch_handshakes(sock: zmq.Socket, address: str) -> None:
    """Log handshake failures on a server socket (a peer without CURVE never reaches ZAP).
    Needs a running loop (every service binds inside ``run``); the watch ends when the
    socket closes."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    if not isinstance(sock, zmq.asyncio.Socket):
        return
    events = zmq.EVENT_MONITOR_STOPPED
    for event in _HANDSHAKE_FAILED:
        events |= event
    # a name of our own: pyzmq's default reuses the fd number, still bound while the
    # reaper closes an old socket
    monitor = sock.get_monitor_socket(events, addr=f"inproc://crescent.monitor.{next(_IDS)}")
    task = loop.create_task(_log_handshakes(monitor, address), name=f"curve-monitor {address}")
    _MONITORS.add(task)
    task.add_done_callback(_MONITORS.discard)


async def _log_handshakes(monitor: zmq.asyncio.Socket, address: str) -> None:
    try:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return
            what = _HANDSHAKE_FAILED.get(event["event"], "handshake failed")
            _THROTTLE.warn(f"hs:{address}:{what}", "%s: dropped a ZeroMQ peer: %s (error %#x)",
                           address, what, event["value"])
    finally:
        monitor.close(0)


# ------------------------------------------------------------------ clamps and paths


def clamp_deadline(deadline: float, max_s: float, now: Optional[float] = None) -> float:
    """A sender-chosen wall-clock ``deadline`` no later than ``max_s`` from ``now``."""
    now = time.time() if now is None else now
    return min(deadline, now + max_s)


def clamp_interval(value: float, low: float, high: float) -> float:
    """A sender-chosen period or timeout within the receiver's ``[low, high]``."""
    return min(max(value, low), high)


# Segment file names, as common/store/shm.py:owned_path makes them:
# crescent-<kind>-<hostname>-<name>-<pid> (a store node's, a worker's KV memory).
STORE_SEGMENT = re.compile(r"crescent-store-[\w.-]+-\d+")
KV_SEGMENT = re.compile(r"crescent-kv-[\w.-]+-\d+")


def checked_shm_path(path: str, directory: Optional[str], name: "re.Pattern[str]") -> str:
    """``path`` if it names a regular file (not a symlink) of this process's user directly
    in ``directory`` whose name matches ``name``; else ValueError. A file a peer names is
    mapped only after this (and opened with O_NOFOLLOW: common/store/shm.py)."""
    if not directory:
        raise ValueError(f"{path!r}: no shared-memory directory is configured here")
    if not isinstance(path, str) or not os.path.isabs(path):
        raise ValueError(f"{path!r} is not an absolute path")
    head, base = os.path.split(os.path.normpath(path))
    if os.path.normpath(path) != path or head != os.path.normpath(directory):
        raise ValueError(f"{path!r} is not directly in {directory}")
    if not name.fullmatch(base):
        raise ValueError(f"{path!r} is not a Crescent segment name")
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ValueError(f"{path!r}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path!r} is not a regular file")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{path!r} belongs to another user (uid {st.st_uid})")
    return path
