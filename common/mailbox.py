"""Inbox/outbox over ZeroMQ: each process binds one PULL and PUSHes to other inboxes."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional, Sequence

import zmq
import zmq.asyncio

from common.ipc import encode, make_socket, try_decode

log = logging.getLogger(__name__)


class Mailbox:
    def __init__(self, inbox: Optional[str], name: str) -> None:
        self.name = name
        self.ctx = zmq.asyncio.Context.instance()
        self.inbox = make_socket(self.ctx, zmq.PULL, inbox, bind=True) if inbox else None
        self._out: dict[str, zmq.asyncio.Socket] = {}

    def _socket(self, address: str) -> zmq.asyncio.Socket:
        sock = self._out.get(address)
        if sock is None:
            sock = make_socket(self.ctx, zmq.PUSH, address, bind=False, hwm=100_000)
            self._out[address] = sock
        return sock

    def send(self, address: str, msg: Any) -> bool:
        """Queue ``msg`` for ``address`` without blocking; False if it cannot be queued."""
        try:
            self._socket(address).send(encode(msg), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.warning("%s: outbox to %s is full; dropped %s", self.name, address,
                        type(msg).__name__)
            return False

    async def recv(self) -> Any:
        """Next valid message; malformed frames are logged and dropped."""
        assert self.inbox is not None
        while True:
            frame = await self.inbox.recv()
            msg = try_decode(frame, self.name)
            if msg is not None:
                return msg

    def close(self) -> None:
        for sock in self._out.values():
            sock.close(0)
        if self.inbox is not None:
            self.inbox.close(0)


class ServiceTaskDied(RuntimeError):
    """A background task of a service (step loop, heartbeats) ended with an error."""


async def serve_inbox(mail: Mailbox, handlers: dict[type, Callable[[Any], None]],
                      tasks: Sequence[asyncio.Task] = ()) -> None:
    """Dispatch inbox messages through ``handlers`` until cancelled.

    A handler error is logged and the loop goes on (one bad message must not stop a
    service). A background task that dies ends the service with ``ServiceTaskDied``, so
    the process exits non-zero and its supervisor sees it.
    """
    main = asyncio.current_task()
    died: list[BaseException] = []

    def watch(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            died.append(task.exception())
            log.error("%s: background task %s died: %r", mail.name, task.get_name(),
                      task.exception())
            if main is not None:
                main.cancel()

    for task in tasks:
        task.add_done_callback(watch)
    try:
        while True:
            msg = await mail.recv()
            handler = handlers.get(type(msg))
            if handler is None:
                log.warning("%s: no handler for %s; dropped", mail.name, type(msg).__name__)
                continue
            try:
                handler(msg)
            except Exception:
                log.exception("%s: handling %s failed", mail.name, type(msg).__name__)
    except asyncio.CancelledError:
        if died:
            raise ServiceTaskDied(repr(died[0])) from died[0]
        raise
    finally:
        for task in tasks:
            task.cancel()
