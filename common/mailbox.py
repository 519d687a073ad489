"""Inboxes over ZeroMQ and the one loop every service serves them with.

Three kinds of inbox, one loop (``serve_inbox``):

- ``Mailbox``: a bound PULL inbox plus PUSH outboxes to other inboxes: one-way messages
  between the serving processes (router, conductor, workers).
- ``RouterInbox``: a bound ROUTER: request/reply with DEALER clients (the store master).
  Its handlers take ``(sender, msg)`` and the reply they return goes back to the sender.
- ``DealerLink``: a DEALER connected to one ROUTER (a store node's link to its master).
  Its handlers take ``msg``; the message they return is sent to the peer.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from collections import Counter
from typing import Any, Callable, Optional, Sequence, Union

import zmq
import zmq.asyncio

from common.ipc import encode, make_socket, try_decode

log = logging.getLogger(__name__)


# Messages queued per outbox before ``send`` drops: a peer that is down (or slow) holds
# at most this many of ours, not an unbounded backlog replayed when it comes back.
OUTBOX_HWM = 10_000


def send_nowait(sock: zmq.asyncio.Socket, frames: list[bytes]) -> Optional[BaseException]:
    """Queue ``frames`` without blocking; the error if they could not be (a full queue, a
    gone peer). An asyncio socket answers a full queue with a future failed at once, not a
    raise: both are caught here, so no drop is silent."""
    try:
        sent = sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        return exc
    if sent is not None and sent.done() and not sent.cancelled():
        return sent.exception()
    return None


class Mailbox:
    def __init__(self, inbox: Optional[str], name: str) -> None:
        self.name = name
        self.ctx = zmq.asyncio.Context.instance()
        self.inbox = make_socket(self.ctx, zmq.PULL, inbox, bind=True) if inbox else None
        self._out: dict[str, zmq.asyncio.Socket] = {}
        self.dropped: Counter[str] = Counter()  # messages dropped on a full outbox, by peer

    def _socket(self, address: str) -> zmq.asyncio.Socket:
        sock = self._out.get(address)
        if sock is None:
            sock = make_socket(self.ctx, zmq.PUSH, address, bind=False, hwm=OUTBOX_HWM)
            self._out[address] = sock
        return sock

    def send(self, address: str, msg: Any) -> bool:
        """Queue ``msg`` for ``address`` without blocking; False if it cannot be queued
        (the outbox is full: the message is dropped, logged and counted)."""
        if send_nowait(self._socket(address), [encode(msg)]) is not None:
            return self._dropped(address, msg)
        return True

    def _dropped(self, address: str, msg: Any) -> bool:
        self.dropped[address] += 1
        log.warning("%s: outbox to %s is full (%d queued); dropped %s (%d so far)",
                    self.name, address, OUTBOX_HWM, type(msg).__name__,
                    self.dropped[address])
        return False

    async def recv(self) -> Any:
        """Next valid message; malformed frames are logged and dropped."""
        assert self.inbox is not None
        while True:
            frame = await self.inbox.recv()
            msg = try_decode(frame, self.name)
            if msg is not None:
                return msg

    async def next(self) -> tuple[None, Any]:
        return None, await self.recv()

    def reply(self, sender: Optional[bytes], msg: Any) -> None:
        log.error("%s: a PULL inbox cannot reply; %s dropped", self.name, type(msg).__name__)

    def close(self) -> None:
        for sock in self._out.values():
            sock.close(0)
        if self.inbox is not None:
            self.inbox.close(0)


class RouterInbox:
    """A bound ROUTER socket: every message comes with its sender's identity."""

    def __init__(self, address: str, name: str) -> None:
        self.name = name
        self.sock = make_socket(zmq.asyncio.Context.instance(), zmq.ROUTER, address, bind=True,
                                hwm=OUTBOX_HWM)

    async def next(self) -> tuple[bytes, Any]:
        """(sender, next valid message); malformed frames are logged and dropped."""
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:  # a DEALER sends one frame; the ROUTER prefixes its id
                log.warning("%s: dropped a message of %d frames from %r (expected 1)",
                            self.name, len(frames) - 1, frames[0])
                continue
            msg = try_decode(frames[1], self.name)
            if msg is not None:
                return frames[0], msg

    def reply(self, sender: bytes, msg: Any) -> None:
        """Send ``msg`` to ``sender`` without blocking; a gone or slow peer loses it."""
        exc = send_nowait(self.sock, [sender, encode(msg)])
        if exc is not None:  # EHOSTUNREACH (ROUTER_MANDATORY) or EAGAIN
            log.warning("%s: %s to %r dropped: %s", self.name, type(msg).__name__, sender, exc)

    def close(self) -> None:
        self.sock.close(0)


class DealerLink:
    """A DEALER connected to one ROUTER peer, under a fixed identity."""

    def __init__(self, address: str, name: str, identity: bytes) -> None:
        self.name = name
        self.sock = make_socket(zmq.asyncio.Context.instance(), zmq.DEALER, address,
                                bind=False, identity=identity, hwm=OUTBOX_HWM)

    async def send(self, msg: Any) -> None:
        """Queue ``msg`` without blocking: with the peer away, beyond ``OUTBOX_HWM`` queued
        messages it is dropped and logged, never waited for."""
        self.reply(None, msg)

    async def request(self, msg: Any, timeout_s: float) -> Optional[Any]:
        """Send ``msg``, then the next valid message within ``timeout_s`` (None: none)."""
        await self.send(msg)
        if await self.sock.poll(timeout_s * 1000):
            return try_decode(await self.sock.recv(), self.name)
        return None

    async def next(self) -> tuple[None, Any]:
        while True:
            msg = try_decode(await self.sock.recv(), self.name)
            if msg is not None:
                return None, msg

    def reply(self, sender: Optional[bytes], msg: Any) -> None:
        exc = send_nowait(self.sock, [encode(msg)])
        if exc is not None:
            log.warning("%s: %s dropped: %s", self.name, type(msg).__name__, exc)

    def close(self) -> None:
        self.sock.close(0)


Inbox = Union[Mailbox, RouterInbox, DealerLink]


class ServiceTaskDied(RuntimeError):
    """A background task of a service (step loop, heartbeats) ended with an error."""


async def serve_inbox(inbox: Inbox, handlers: dict[type, Callable[..., Any]],
                      tasks: Sequence[asyncio.Task] = (),
                      after: Optional[Callable[[Any], None]] = None) -> None:
    """Dispatch inbox messages through ``handlers`` until cancelled.

    A handler takes ``msg`` (``(sender, msg)`` on a ``RouterInbox``) and may be a
    coroutine; what it returns, if not None, is the reply (see the module doc). ``after``
    runs after every handled message. A handler error is logged and the loop goes on (one
    bad message must not stop a service). A background task that dies ends the service
    with ``ServiceTaskDied``, so the process exits non-zero and its supervisor sees it.
    """
    main = asyncio.current_task()
    died: list[BaseException] = []

    def watch(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            died.append(task.exception())
            log.error("%s: background task %s died: %r", inbox.name, task.get_name(),
                      task.exception())
            if main is not None:
                main.cancel()

    for task in tasks:
        task.add_done_callback(watch)
    try:
        while True:
            sender, msg = await inbox.next()
            handler = handlers.get(type(msg))
            if handler is None:
                log.warning("%s: no handler for %s; dropped", inbox.name, type(msg).__name__)
                continue
            try:
                reply = handler(msg) if sender is None else handler(sender, msg)
                if inspect.isawaitable(reply):
                    reply = await reply
                if reply is not None:
                    inbox.reply(sender, reply)
                if after is not None:
                    after(msg)
            except Exception:
                log.exception("%s: handling %s failed", inbox.name, type(msg).__name__)
    except asyncio.CancelledError:
        if died:
            raise ServiceTaskDied(repr(died[0])) from died[0]
        raise
    finally:
        for task in tasks:
            task.cancel()
