"""The other routers' request logs, for this router's dashboard (``routers`` > 1).

Each router keeps the timelines of the requests it took (services/router/dashboard_log.py);
behind one port or one load balancer a page would show whichever router answered it. So
the dashboard asks every other router over its inbox (``RequestLogQuery``), waits for
their replies (``RequestLogReply``) up to ``PEER_TIMEOUT_S``, and shows the log of all of
them; a router that did not answer in time is named, not waited for.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Any

from common.config import ClusterConfig
from common.ipc import message
from common.mailbox import Mailbox
from services.router.dashboard_log import RequestLog

PEER_TIMEOUT_S = 0.5  # the page polls every second


def router_name(index: int) -> str:
    return f"router-{index}"


@message
class RequestLogQuery:
    """Router → another router of the cluster: its dashboard's request log, answered to
    ``reply_to`` with this ``query``."""

    query: int
    reply_to: str


@message
class RequestLogReply:
    """Router → the router that asked: its finished requests, newest first, as its own
    dashboard shows them (``RequestLog.timelines``)."""

    query: int
    router: str  # ``router_name``
    requests: list[dict[str, Any]]


class PeerLogs:
    def __init__(self, config: ClusterConfig, mailbox: Mailbox, index: int,
                 log: RequestLog) -> None:
        self.config, self.mailbox, self.log = config, mailbox, log
        self.name = router_name(index)
        self.inbox = config.inbox("router", index)
        self.others = [i for i in range(config.routers) if i != index]
        self._queries = itertools.count(1)
        # a query in flight: the logs heard so far by router name, set once all are in
        self._waiting: dict[int, tuple[dict[str, list[dict[str, Any]]], asyncio.Event]] = {}

    def answer(self, msg: RequestLogQuery) -> None:
        """Another router asks for this one's log."""
        self.mailbox.send(msg.reply_to, RequestLogReply(msg.query, self.name,
                                                        self.log.timelines()))

    def heard(self, msg: RequestLogReply) -> None:
        waiting = self._waiting.get(msg.query)
        if waiting is None:  # late: its query gave up on it
            return
        logs, done = waiting
        logs[msg.router] = msg.requests
        if len(logs) == len(self.others):
            done.set()

    async def gather(self, timeout_s: float = PEER_TIMEOUT_S
                     ) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
        """(each other router's log that came in time, the routers that did not answer)."""
        query = next(self._queries)
        logs: dict[str, list[dict[str, Any]]] = {}
        done = asyncio.Event()
        self._waiting[query] = (logs, done)
        try:
            for i in self.others:
                self.mailbox.send(self.config.inbox("router", i),
                                  RequestLogQuery(query, self.inbox))
            try:
                await asyncio.wait_for(done.wait(), timeout_s)
            except TimeoutError:
                pass
        finally:
            del self._waiting[query]
        silent = [router_name(i) for i in self.others if router_name(i) not in logs]
        return dict(logs), silent


def merged(own: str, log: list[dict[str, Any]], peers: dict[str, list[dict[str, Any]]],
           keep: int) -> list[dict[str, Any]]:
    """Every router's finished requests, each named by its router, newest end first, the
    last ``keep`` of them."""
    rows = [{**r, "router": own} for r in log]
    for router, theirs in peers.items():
        rows += [{**r, "router": router} for r in theirs]
    rows.sort(key=lambda r: r["ended"], reverse=True)
    return rows[:keep]
