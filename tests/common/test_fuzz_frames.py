"""Malformed frames on every kind of ZeroMQ inbox are dropped and logged, and the service
keeps serving: a valid message sent after them is still handled.

Frames come from hypothesis: random bytes, truncated valid frames, valid frames with a
field of the wrong type, a missing or an unknown field, unknown message names, valid JSON
of the wrong shape, numbers JSON cannot hold, deep nesting. Only frames the codec refuses
are sent (a mutation that happens to stay valid is skipped). Targets: ``serve_inbox`` on a
``Mailbox``, a ``RouterInbox`` and a ``DealerLink`` in-process, and a real conductor
(PULL) and store master (ROUTER) started as ``python -m services.X --set ...``.
"""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from common.ipc import decode, encode
from common.mailbox import DealerLink, Mailbox, RouterInbox, serve_inbox
from common.protocol import (AbortRequest, RegisterWorker, RequestFailed, RequestRejected,
                             SubmitRequest, TokenDelta)
from common.sampling_params import SamplingParams
import common.status_protocol  # noqa: F401 - registers ClusterStatus, which the conductor sends
from common.store import protocol as sp

REPO = Path(__file__).resolve().parents[2]
PORT = 20780  # this file's ports: 20780-20782 in-process, 20740-20745 conductor,
CONDUCTOR_BASE = 20740  # 20760-20765 store master
STORE_BASE = 20760
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.filter_too_much])

SAMPLES = [encode(m) for m in [
    SubmitRequest("r1", [1, 2, 3], ["ab"], SamplingParams(max_tokens=4), 1.0),
    AbortRequest("r1", "x"),
    RegisterWorker("prefill-9", "prefill", "tcp://127.0.0.1:1", "127.0.0.1:2", 0, 64, 8, 4, 16),
    TokenDelta("r1", [5], "a", None, None, 3, 1),
    sp.StoreGet(1, ["ab"]), sp.StorePutStart(2, ["cd"], 64),
    sp.NodeRegister("n", "h", "127.0.0.1:3", 0, 1 << 20, 0, "/dev/shm/x"),
]]
_huge = st.sampled_from([2 ** 64, -(2 ** 63) - 1, 10 ** 40])
_scalars = st.none() | st.booleans() | st.integers(-10, 10) | _huge | st.floats() | st.text(
    max_size=12)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def _dump(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # a number orjson cannot write: write it by hand, still JSON text
        return repr(value).encode()


@st.composite
def junk_frames(draw: st.DrawFn) -> bytes:
    sample = draw(st.sampled_from(SAMPLES))
    body = orjson.loads(sample)
    shape = draw(st.sampled_from(["bytes", "truncated", "wrong_type", "missing", "extra",
                                  "unknown_name", "wrong_shape", "huge", "deep"]))
    if shape == "bytes":
        frame = draw(st.binary(max_size=256))
    elif shape == "truncated":
        frame = sample[:draw(st.integers(0, len(sample) - 1))]
    elif shape == "wrong_type":
        name = draw(st.sampled_from(sorted(body)))
        frame = _dump(dict(body, **{name: draw(_json)}))
    elif shape == "missing":
        body.pop(draw(st.sampled_from(sorted(k for k in body if k != "type"))))
        frame = _dump(body)
    elif shape == "extra":
        frame = _dump(dict(body, **{draw(st.text(min_size=1, max_size=8)): draw(_json)}))
    elif shape == "unknown_name":
        frame = _dump(dict(body, type=draw(st.text(max_size=20) | _json)))
    elif shape == "wrong_shape":
        frame = _dump(draw(_json))
    elif shape == "huge":
        frame = sample.replace(b"1", str(draw(_huge)).encode(), 1)
    else:
        depth = draw(st.integers(100, 5000))
        frame = b'{"type":"AbortRequest","request_id":' + b"[" * depth + b"]" * depth + b"}"
    assume(_refused(frame))
    return frame


def _refused(frame: bytes) -> bool:
    """Whether the codec refuses ``frame`` (any exception counts: the loop must survive it)."""
    try:
        decode(frame)
    except Exception:  # noqa: BLE001 - a non-ProtocolError is exactly what we hunt for
        return True
    return False


class DropLog(logging.Handler):
    """Counts the warnings of dropped frames and messages."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "dropped" in record.getMessage():
            self.count += 1


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


# --------------------------------------------------------------------------- in-process
class Inboxes:
    """A Mailbox, a RouterInbox and a DealerLink, each served by ``serve_inbox`` on one
    event loop in a thread; handlers record what they get."""

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.loop = asyncio.new_event_loop()
        self.tasks: list[asyncio.Task] = []
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.ctx = zmq.Context()
        self.master = self.ctx.socket(zmq.ROUTER)  # the DealerLink's peer
        self.master.setsockopt(zmq.LINGER, 0)
        try:
            self.master.bind(f"tcp://127.0.0.1:{PORT + 2}")
        except zmq.ZMQError:  # not left to the garbage collector: its term() would block
            self.master.close(0)
            self.ctx.term()
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        record = self.seen.append
        mail = Mailbox(f"tcp://127.0.0.1:{PORT}", "fuzz-mailbox")
        router = RouterInbox(f"tcp://127.0.0.1:{PORT + 1}", "fuzz-router")
        dealer = DealerLink(f"tcp://127.0.0.1:{PORT + 2}", "fuzz-dealer", b"fuzz-node")
        self.tasks = [
            asyncio.create_task(serve_inbox(mail, {AbortRequest: record})),
            asyncio.create_task(serve_inbox(router, {
                sp.StoreStats: lambda sender, m: sp.StoreStatsReply(m.req_id, {})})),
            asyncio.create_task(serve_inbox(dealer, {AbortRequest: record}))]
        self.ready.set()
        try:
            await asyncio.gather(*self.tasks)
        except asyncio.CancelledError:
            pass
        finally:
            for inbox in (mail, router, dealer):
                inbox.close()

    def alive(self) -> bool:
        return all(not t.done() for t in self.tasks)

    def stop(self) -> None:
        for t in self.tasks:
            self.loop.call_soon_threadsafe(t.cancel)
        self.thread.join(5)
        self.master.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def inboxes() -> Iterator[Inboxes]:
    box = Inboxes()
    box.thread.start()
    assert box.ready.wait(5)
    yield box
    box.stop()


@pytest.fixture(scope="module")
def drops() -> Iterator[DropLog]:
    handler = DropLog()
    root = logging.getLogger()
    root.addHandler(handler)
    yield handler
    root.removeHandler(handler)


def _socket(ctx: zmq.Context, kind: int, address: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


@pytest.mark.parametrize("kind", ["mailbox", "router_inbox", "dealer_link"])
@SETTINGS
@given(frames=st.lists(junk_frames(), min_size=1, max_size=4))
def test_inbox_drops_and_logs_junk(inboxes: Inboxes, drops: DropLog, kind: str,
                                   frames: list[bytes]) -> None:
    """Junk, then a valid message: handled (answered, on the RouterInbox); every junk
    frame logged; the loop still running."""
    sock = None
    if kind == "dealer_link":  # from its ROUTER peer, to the link's identity
        def send(frame: bytes) -> None:
            inboxes.master.send_multipart([b"fuzz-node", frame])
    else:
        sock = _socket(inboxes.ctx, zmq.PUSH if kind == "mailbox" else zmq.DEALER,
                       f"tcp://127.0.0.1:{PORT + (kind == 'router_inbox')}")
        send = sock.send
    try:
        before = drops.count
        for frame in frames:
            send(frame)
        if sock is not None and kind == "router_inbox":
            req_id = time.monotonic_ns() % (1 << 40)
            send(encode(sp.StoreStats(req_id)))
            assert sock.poll(5000), "valid request not answered"
            assert decode(sock.recv()) == sp.StoreStatsReply(req_id, {})
        else:
            sentinel = AbortRequest(f"ok-{time.monotonic_ns()}")
            send(encode(sentinel))
            assert wait_for(lambda: sentinel in inboxes.seen), "valid message not handled"
        assert inboxes.alive()
        assert wait_for(lambda: drops.count >= before + len(frames))
    finally:
        if sock is not None:
            sock.close(0)


def test_router_inbox_logs_a_wrong_number_of_frames(inboxes: Inboxes, drops: DropLog) -> None:
    dealer = _socket(inboxes.ctx, zmq.DEALER, f"tcp://127.0.0.1:{PORT + 1}")
    try:
        before = drops.count
        dealer.send_multipart([b"", SAMPLES[0], b"x"])
        dealer.send(encode(sp.StoreStats(7)))
        assert dealer.poll(5000) and decode(dealer.recv()) == sp.StoreStatsReply(7, {})
        assert wait_for(lambda: drops.count > before, 1.0)
    finally:
        dealer.close(0)


def test_foreign_valid_messages_are_dropped_and_logged(inboxes: Inboxes,
                                                       drops: DropLog) -> None:
    """A valid message of a type the inbox has no handler for: logged, dropped."""
    push = _socket(inboxes.ctx, zmq.PUSH, f"tcp://127.0.0.1:{PORT}")
    try:
        before = drops.count
        for frame in SAMPLES:
            if not frame.startswith(b'{"type":"AbortRequest"'):
                push.send(frame)
        push.send(encode(AbortRequest("after-foreign")))
        assert wait_for(lambda: AbortRequest("after-foreign") in inboxes.seen)
        assert wait_for(lambda: drops.count >= before + len(SAMPLES) - 1)
    finally:
        push.close(0)


# --------------------------------------------------------------------------- real services
class Service:
    """One real service process (``python -m services.<role> --set ...``), its log a file."""

    def __init__(self, role: str, log: Path, *sets: str) -> None:
        args = [sys.executable, "-m", f"services.{role}"]
        for item in sets:
            args += ["--set", item]
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                         env=env, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_line(self, line: str, timeout: float = 30.0) -> None:
        if not wait_for(lambda: line in self.text() or self.proc.poll() is not None, timeout):
            raise AssertionError(f"no {line!r} in {self.log}:\n{self.text()[-2000:]}")
        assert self.proc.poll() is None, self.text()[-2000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def conductor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, zmq.Socket]]:
    """A real conductor (no workers, no store) and a PULL bound at the router's inbox."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.PULL)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{CONDUCTOR_BASE}")
    svc = Service("conductor", tmp_path_factory.mktemp("fuzz") / "conductor.log",
                  f"base_port={CONDUCTOR_BASE}", "store.enabled=false",
                  "heartbeat_interval_s=0.2", "worker_wait_s=0")  # no workers: answer at once
    try:
        svc.wait_line("conductor ready")
        yield svc, router
    finally:
        svc.stop()
        router.close(0)


@pytest.fixture(scope="module")
def store_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service("store_master", tmp_path_factory.mktemp("fuzz") / "store_master.log",
                  f"base_port={STORE_BASE}")
    try:
        svc.wait_line("store master listening")
        yield svc
    finally:
        svc.stop()


def _answer_to(router: zmq.Socket, request_id: str, timeout: float = 5.0) -> Any:
    """The conductor's answer about ``request_id`` on the router inbox (status skipped)."""
    deadline = time.monotonic() + timeout
    while router.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        msg = decode(router.recv())
        if getattr(msg, "request_id", None) == request_id:
            return msg
    return None


@SETTINGS
@given(frames=st.lists(junk_frames(), min_size=1, max_size=4))
def test_real_conductor_survives_junk(conductor: tuple[Service, zmq.Socket],
                                      frames: list[bytes]) -> None:
    svc, router = conductor
    push = _socket(zmq.Context.instance(), zmq.PUSH, f"tcp://127.0.0.1:{CONDUCTOR_BASE + 1}")
    try:
        for frame in frames:
            push.send(frame)
        rid = f"fuzz-{time.monotonic_ns()}"
        push.send(encode(SubmitRequest(rid, [1, 2], [], SamplingParams(max_tokens=2), 0.0)))
        answer = _answer_to(router, rid)
        assert isinstance(answer, (RequestFailed, RequestRejected)), answer  # no workers
        assert svc.proc.poll() is None
    finally:
        push.close(0)


@SETTINGS
@given(frames=st.lists(junk_frames(), min_size=1, max_size=4))
def test_real_store_master_survives_junk(store_master: Service, frames: list[bytes]) -> None:
    dealer = _socket(zmq.Context.instance(), zmq.DEALER, f"tcp://127.0.0.1:{STORE_BASE + 2}")
    try:
        for frame in frames:
            dealer.send(frame)
        req_id = time.monotonic_ns() % (1 << 40)
        dealer.send(encode(sp.StoreStats(req_id)))
        assert dealer.poll(5000), "valid request not answered"
        reply = decode(dealer.recv())
        assert isinstance(reply, sp.StoreStatsReply) and reply.req_id == req_id
        assert store_master.proc.poll() is None
    finally:
        dealer.close(0)


def test_real_services_logged_every_dropped_frame(conductor: tuple[Service, zmq.Socket],
                                                  store_master: Service) -> None:
    """Runs after the two fuzz tests above (file order): each logged its drops."""
    for svc in (conductor[0], store_master):
        assert svc.text().count("dropped malformed frame") >= 20, svc.log
        assert "Traceback" not in svc.text(), svc.text()[-3000:]
