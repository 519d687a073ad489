"""The router's state and inbox loop: one queue per live request, the latest ClusterStatus.

The inbox loop dispatches by message type through one table; request events go to the
queue of their request (dropped if the request is gone), ClusterStatus replaces the last.
The conductor publishes a status every heartbeat; none for ``heartbeat_timeout_s`` (the
limit the conductor itself gives a worker) means it is gone: ``conductor_lost``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

from common.config import ClusterConfig
from common.drain import Drain, current as current_drain
from common.mailbox import Mailbox
from common.protocol import (
    AbortRequest, RequestAccepted, RequestFailed, RequestRejected, SubmitRequest, TokenDelta,
    TokenDeltas,
)
from common.status_protocol import ClusterStatus
from services.router.block_hashing import BlockHasher
from services.router.dashboard_log import RequestLog
from services.router.metrics import RouterMetrics
from services.router.peer_logs import PeerLogs, RequestLogQuery, RequestLogReply, router_name
from services.router.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)

RequestEvent = Union[RequestAccepted, TokenDelta, RequestFailed, RequestRejected]


@dataclass
class RouterState:
    config: ClusterConfig
    mailbox: Mailbox
    tokenizer: PromptTokenizer
    block_keys: BlockHasher  # (token ids, LoRA adapter) → the blocks' keys
    index: int = 0  # which of the cluster's routers (config.routers) this is
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    requests: RequestLog = field(default_factory=RequestLog)  # the dashboard's timelines
    streams: dict[str, asyncio.Queue] = field(default_factory=dict)
    status: Optional[ClusterStatus] = None
    status_time: Optional[float] = None  # monotonic time the status arrived
    started: int = field(default_factory=lambda: int(time.time()))
    born: float = field(default_factory=time.monotonic)  # counts as a status at start
    drain: Drain = field(default_factory=current_drain)  # SIGTERM (common/drain.py)
    restarted_at: Optional[float] = None  # monotonic time a new conductor epoch was seen
    peer_logs: PeerLogs = field(init=False)  # the other routers' logs, for the dashboard

    def __post_init__(self) -> None:
        self.peer_logs = PeerLogs(self.config, self.mailbox, self.index, self.requests)

    @property
    def name(self) -> str:
        """``router-<index>``: in logs, the X-Crescent-Router header and the dashboard."""
        return router_name(self.index)

    # ------------------------------------------------------------ conductor side
    @property
    def conductor(self) -> str:
        return self.config.inbox("conductor")

    def submit(self, req: SubmitRequest) -> asyncio.Queue:
        """Open the request's event queue, then hand the request to the conductor."""
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[req.request_id] = queue
        if not req.router_inbox:  # its answers and tokens come to this router
            req = replace(req, router_inbox=self.config.inbox("router", self.index))
        if not self.mailbox.send(self.conductor, req):
            self.streams.pop(req.request_id, None)
            raise ConnectionError("the conductor's inbox is not accepting messages")
        return queue

    def abort(self, request_id: str, reason: str) -> None:
        self.close(request_id)
        self.mailbox.send(self.conductor, AbortRequest(request_id, reason))

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    # ------------------------------------------------------------ readiness
    def status_age(self) -> Optional[float]:
        return None if self.status_time is None else time.monotonic() - self.status_time

    def conductor_lost(self) -> Optional[float]:
        """Seconds without a ClusterStatus (since start if none came) once beyond
        ``heartbeat_timeout_s``; None while the conductor is heard from."""
        silent = time.monotonic() - (self.status_time or self.born)
        return silent if silent > self.config.heartbeat_timeout_s else None

    @property
    def draining(self) -> bool:
        return self.drain.active

    def is_ready(self) -> bool:
        age = self.status_age()
        return (self.status is not None and self.status.ready and age is not None
                and age < 3 * self.config.heartbeat_interval_s)

    # ------------------------------------------------------------ inbox
    def _on_request_event(self, msg: RequestEvent) -> None:
        queue = self.streams.get(msg.request_id)
        if queue is None:
            log.debug("dropped %s for gone request %s", type(msg).__name__, msg.request_id)
            return
        queue.put_nowait(msg)

    def _on_deltas(self, msg: TokenDeltas) -> None:
        for delta in msg.deltas:  # one decode step's, for requests of this router
            self._on_request_event(delta)

    def _on_status(self, msg: ClusterStatus) -> None:
        if self.status is not None and msg.conductor_epoch != self.status.conductor_epoch:
            self.restarted_at = time.monotonic()
            log.warning("a new conductor (epoch %d): requests its predecessor accepted get "
                        "%.0f s to show progress", msg.conductor_epoch, self.orphan_grace_s)
        self.status = msg
        self.status_time = time.monotonic()
        self.requests.heard(msg, time.time())

    @property
    def orphan_grace_s(self) -> float:
        """How long a request waits for any word after the conductor that took it was
        replaced (work already handed to workers still completes without a conductor)."""
        return 4 * self.config.heartbeat_timeout_s

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        return {RequestAccepted: self._on_request_event, TokenDelta: self._on_request_event,
                TokenDeltas: self._on_deltas, RequestFailed: self._on_request_event,
                RequestRejected: self._on_request_event, ClusterStatus: self._on_status,
                RequestLogQuery: self.peer_logs.answer, RequestLogReply: self.peer_logs.heard}
