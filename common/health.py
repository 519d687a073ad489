"""``GET /health`` on every process, for Kubernetes probes and compose healthchecks.

Workers and store nodes speak only ZeroMQ, and the HTTP listeners the router, conductor and
store master already have sit on different ports with different meanings; an orchestrator
needs one path it can ask every role. The bootstrap (common/service.py) wraps each service's
``run`` in ``serve``.

Off unless the config sets ``health_port``. Then a process listens on ``health_port + n``,
where n counts the processes before it in the cluster's layout (``layout``: router,
conductor, store master, prefill, decode, store nodes, colocated, as ``ClusterConfig.inbox``
orders them) that have the same address (``ClusterConfig.address``). So every process of a
cluster on one host (``crescent up``, compose's host network) gets its own port, while in
Kubernetes, where each process is its own pod with its own name, every one listens on
``health_port`` itself and one probe fits a whole StatefulSet. Two clusters on one host keep
their ``health_port`` ranges apart as they do their ``base_port`` ranges.

The answer comes from the service's own event loop: 200 while it turns, 503 once SIGTERM
began a drain (common/drain.py: the pod leaves its Service while it finishes its work), and
no answer while the loop is blocked, e.g. a worker building its engine at start.
"""
from __future__ import annotations

import os
from contextlib import asynccontextmanager
from typing import AsyncIterator, Iterator, Optional

from aiohttp import web

from common.config import ClusterConfig
from common.config_hosts import INDEXED_ROLES, SINGLE_ROLES
from common.drain import current as current_drain

PATH = "/health"


def layout(config: ClusterConfig) -> Iterator[tuple[str, int]]:
    """(role, index) of every process of the cluster, in the port layout's order: the
    routers after the first come last (config.inbox), so they move no other port."""
    for role in SINGLE_ROLES:
        yield role, 0
    for role in INDEXED_ROLES:
        for index in range(config.processes(role)):
            yield role, index
    for index in range(1, config.routers):
        yield "router", index


def health_port(config: ClusterConfig, role: str, index: int = 0) -> Optional[int]:
    """The ``/health`` port of process (role, index); None when ``health_port`` is unset."""
    return nth_port(config, config.health_port, role, index)


def nth_port(config: ClusterConfig, first: Optional[int], role: str,
             index: int = 0) -> Optional[int]:
    """``first + n``, n counting the processes before (role, index) in ``layout`` that
    have its address (None when ``first`` is): the ``/health`` ports, and the workers'
    ``/metrics`` ports (common/worker_metrics.py)."""
    if first is None:
        return None
    here = config.address(role, index)
    before = 0
    for other in layout(config):
        if other == (role, index):
            return first + before
        before += config.address(*other) == here
    raise ValueError(f"no process {role}-{index} in this cluster")


@asynccontextmanager
async def serve(config: ClusterConfig, role: str, index: int) -> AsyncIterator[Optional[int]]:
    """Answer ``/health`` for the body of the ``async with``; yields the port (None: off).
    A port already taken raises ``OSError``, which the bootstrap turns into exit 1."""
    port = health_port(config, role, index)
    if port is None:
        yield None
        return
    about = {"role": role, "index": index, "pid": os.getpid()}

    async def health(request: web.Request) -> web.Response:
        if current_drain().active:
            return web.json_response({"status": "unavailable", "reason": "shutting down",
                                      **about}, status=503)
        return web.json_response({"status": "ok", **about})

    app = web.Application()
    app.router.add_get(PATH, health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.listen_host(role, index), port).start()
        yield port
    finally:
        await runner.cleanup()
