"""The dashboard's request log across routers (services/router/peer_logs.py): a query to
each other router, their logs merged newest first and named by router, a router that does
not answer in time named and not waited for, a late reply dropped. The routers' inboxes
are an in-memory fake here; tests/e2e/test_two_routers.py runs two real routers."""
from __future__ import annotations

import asyncio
from typing import Any

from common.config import ClusterConfig
from services.router.dashboard_log import RequestLog
from services.router.peer_logs import PeerLogs, RequestLogReply, merged


class Inboxes:
    """Delivers what one router sends to the router whose inbox it names, on the loop."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.routers: dict[str, PeerLogs] = {}
        self.mute: set[str] = set()  # routers that receive but never answer

    def send(self, address: str, msg: Any) -> bool:
        target = self.routers[address]
        handle = target.heard if type(msg).__name__ == "RequestLogReply" else target.answer
        if target.name not in self.mute or handle == target.heard:
            asyncio.get_running_loop().call_soon(handle, msg)
        return True


def _routers(n: int) -> tuple[Inboxes, list[PeerLogs]]:
    config = ClusterConfig(routers=n, base_port=21900)
    inboxes = Inboxes(config)
    made = []
    for i in range(n):
        log = RequestLog(keep=3)
        for k in range(2):  # two finished requests each, ended at i + k / 10
            log.arrived(f"r{i}-{k}", "chat", 100.0 + i)
            log.finished(f"r{i}-{k}", 200, None, 100.5 + i + k / 10)
        peers = PeerLogs(config, inboxes, i, log)  # type: ignore[arg-type]
        inboxes.routers[config.inbox("router", i)] = peers
        made.append(peers)
    return inboxes, made


def test_every_routers_log_merged_newest_first() -> None:
    _, (first, *_) = _routers(3)
    logs, silent = asyncio.run(first.gather(timeout_s=5))
    assert silent == [] and sorted(logs) == ["router-1", "router-2"]
    rows = merged("router-0", first.log.timelines(), logs, keep=4)
    assert [(r["router"], r["request_id"]) for r in rows] == [
        ("router-2", "r2-1"), ("router-2", "r2-0"), ("router-1", "r1-1"),
        ("router-1", "r1-0")]


def test_a_silent_router_is_named_not_waited_for() -> None:
    inboxes, (first, *_) = _routers(3)
    inboxes.mute.add("router-2")
    logs, silent = asyncio.run(first.gather(timeout_s=0.2))
    assert list(logs) == ["router-1"] and silent == ["router-2"]
    assert first._waiting == {}
    first.heard(RequestLogReply(1, "router-2", []))  # after the deadline: dropped
    assert first._waiting == {}
