"""The live cluster page: ``GET /dashboard`` (one self-contained HTML file: inline CSS and
script, no build step, nothing fetched from elsewhere) and ``GET /debug/dashboard`` (its
numbers as JSON, services/router/dashboard_data.py), which the page polls every second.

The page itself holds no data, so it is open like ``/health``; the JSON names every worker
and the last requests, so it sits under ``/debug/`` and needs the API key when keys are
configured, like ``/debug/pools`` (services/router/auth.py). The page asks for the key on
a 401 and keeps it for the browser tab only (sessionStorage). Its ``worker_metrics`` are
each worker's own ``/metrics``, read while the page polls (services/router/worker_scrape.py);
with several routers its request log is all of theirs (services/router/peer_logs.py).
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson
from aiohttp import web

from services.router.dashboard_data import dashboard_data
from services.router.handlers import STATE
from services.router.worker_scrape import WorkerScrapes

PAGE = Path(__file__).with_name("dashboard.html")
_PAGE_BYTES: web.AppKey[bytes] = web.AppKey("dashboard_page", bytes)
_SCRAPES: web.AppKey[WorkerScrapes] = web.AppKey("worker_scrapes", WorkerScrapes)
# The browser itself holds the page to its own script and style and to this router.
POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
          "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
          "frame-ancestors 'none'")


async def page(request: web.Request) -> web.Response:
    return web.Response(body=request.app[_PAGE_BYTES], content_type="text/html",
                        charset="utf-8", headers={"Cache-Control": "no-cache",
                                                  "Content-Security-Policy": POLICY})


async def data(request: web.Request) -> web.Response:
    state = request.app[STATE]
    scrapes = request.app[_SCRAPES]
    peers = None
    if state.config.routers > 1:  # the other routers' logs, asked while workers are scraped
        peers, _ = await asyncio.gather(state.peer_logs.gather(), scrapes.refresh())
    else:
        await scrapes.refresh()
    body = orjson.dumps({**dashboard_data(state, time.time(), peers),
                         "worker_metrics": scrapes.section()})
    return web.Response(body=body, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def add_dashboard(app: web.Application) -> None:
    """Register both routes; the page is read once, here (a missing file stops startup)."""
    app[_PAGE_BYTES] = PAGE.read_bytes()
    app[_SCRAPES] = WorkerScrapes(app[STATE].config)
    app.add_routes([web.get("/dashboard", page), web.get("/debug/dashboard", data)])

    async def close_scrapes(app: web.Application) -> None:
        await app[_SCRAPES].close()

    app.on_cleanup.append(close_scrapes)
