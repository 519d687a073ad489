"""The router process: one event loop running the aiohttp app and the inbox loop
(started by the one bootstrap, common/service.py)."""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional

from aiohttp import web

from common.config import ClusterConfig
from common.health import nth_port
from common.mailbox import Mailbox, serve_inbox
from services.router.auth import api_key_middleware, load_api_keys
from services.router.block_hashing import make_block_hasher
from services.router.dashboard import add_dashboard
from services.router.errors import ApiError
from services.router.handlers import STATE, metrics, routes
from services.router.peer_logs import router_name
from services.router.state import RouterState
from services.router.tokenizer import load_tokenizer

log = logging.getLogger("services.router")

MAX_BODY = 64 << 20  # token-id prompts of 128k tokens fit
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _http_error(exc: web.HTTPException, request: web.Request) -> ApiError:
    if exc.status == 404:
        return ApiError(404, f"no route for {request.method} {request.path}",
                        code="not_found")
    if exc.status == 405:
        return ApiError(405, f"method {request.method} is not allowed on {request.path}",
                        code="method_not_allowed")
    if exc.status == 413:
        return ApiError(413, f"the request body exceeds {MAX_BODY} bytes",
                        code="request_too_large")
    return ApiError(exc.status, exc.reason or "HTTP error", code=None)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error the client sees is OpenAI-shaped JSON; nothing escapes as a crash."""
    try:
        return await handler(request)
    except ApiError as err:
        return err.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error(exc, request).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # noqa: BLE001 - the server must survive any handler bug
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, f"internal error: {type(exc).__name__}",
                        code="internal_error").response()


def build_app(state: RouterState) -> web.Application:
    keys = load_api_keys(state.config.security)  # none: the API is open
    middlewares = [error_middleware] + ([api_key_middleware(keys)] if keys else [])
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY)
    app[STATE] = state
    app.add_routes(routes())
    add_dashboard(app)
    async def name_the_router(_: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Crescent-Router"] = state.name  # which of the routers answered

    app.on_response_prepare.append(name_the_router)
    return app


def own_metrics_port(config: ClusterConfig, index: int) -> Optional[int]:
    """Where router ``index`` also answers ``/metrics`` for itself alone: with several
    routers, the shared port's ``/metrics`` is whichever router takes the connection. Its
    slot among the processes' ``metrics_port + n`` (common/health.py ``nth_port``), kept
    for every process; None with one router or no ``metrics_port``."""
    if config.routers == 1:
        return None
    return nth_port(config, config.metrics_port, "router", index)


def metrics_app(state: RouterState) -> web.Application:
    app = web.Application()
    app[STATE] = state
    app.add_routes([web.get("/metrics", metrics)])
    return app


async def run(config: ClusterConfig, index: int = 0) -> None:
    """Serve until cancelled: load the tokenizer, bind the inbox, listen on HTTP."""
    tokenizer = await asyncio.to_thread(load_tokenizer, config.model)
    hasher = make_block_hasher(config.block_size, tokenizer.model_config,
                               config.kv_storage_dtype, config.quantization,
                               config.lora_modules)
    mailbox = Mailbox(config.inbox("router", index, bind=True), router_name(index))
    state = RouterState(config, mailbox, tokenizer, hasher, index=index)
    state.drain.until(lambda: not state.streams)  # SIGTERM: finish the streams in flight
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()

    async def listen() -> None:
        if config.routers > 1:  # the port is shared: join it ready, as the kernel hands a
            while not state.is_ready():  # new listener connections at once
                await asyncio.sleep(0.05)
        await web.TCPSite(runner, config.listen_host("router", index), config.http_port,
                          reuse_port=config.routers > 1).start()
        keyed = config.security.api_keys or config.security.api_key_file
        log.info("router ready on http://%s:%d%s (%s of %d)", config.address("router", index),
                 config.http_port, " (API keys required)" if keyed else "", state.name,
                 config.routers)

    own: Optional[web.AppRunner] = None  # its own /metrics, with several routers
    port = own_metrics_port(config, index)
    if port is not None:
        own = web.AppRunner(metrics_app(state), access_log=None)
        await own.setup()
        await web.TCPSite(own, config.listen_host("router", index), port).start()
    try:
        await serve_inbox(mailbox, state.handlers(), [asyncio.create_task(listen())])
    finally:
        await runner.cleanup()
        if own is not None:
            await own.cleanup()
        mailbox.close()
