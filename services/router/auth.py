"""Optional API keys (``[security] api_keys`` / ``api_key_file``): every ``/v1/*``,
``/debug/*``, ``/tokenize`` and ``/detokenize`` request needs ``Authorization: Bearer
<key>``, else a 401 OpenAI-style error (``invalid_api_key``).

``/health`` and ``/metrics`` stay open: load balancers and Prometheus scrapers poll them,
and neither shows a prompt, a key or a per-instance detail (``/debug/pools`` does). Unknown
paths under the guarded prefixes answer 401 too, so a caller without a key learns nothing
of the routes. No keys configured: the API is open, as before.
"""
from __future__ import annotations

import hmac
from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web

from common.security import SecurityConfig
from common.service import StartupError
from services.router.errors import ApiError

GUARDED = ("/v1/", "/debug/", "/tokenize", "/detokenize")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def load_api_keys(config: SecurityConfig) -> tuple[bytes, ...]:
    """The keys of ``api_keys`` and of ``api_key_file`` (one per line; blank lines and
    ``#`` comments skipped). An unreadable or empty file stops the router."""
    keys = [k.strip() for k in config.api_keys]
    if config.api_key_file:
        try:
            text = Path(config.api_key_file).read_text()
        except OSError as exc:
            raise StartupError(f"security.api_key_file: {exc}") from None
        found = [line.strip() for line in text.splitlines()
                 if line.strip() and not line.strip().startswith("#")]
        if not found:
            raise StartupError(f"security.api_key_file: {config.api_key_file} holds no key")
        keys += found
    return tuple(dict.fromkeys(k.encode() for k in keys))


def _refusal(message: str) -> web.Response:
    resp = ApiError(401, message, code="invalid_api_key",
                    error_type="invalid_request_error").response()
    resp.headers["WWW-Authenticate"] = 'Bearer realm="crescent"'
    return resp


def api_key_middleware(keys: tuple[bytes, ...]) -> Callable[..., Awaitable[web.StreamResponse]]:
    """aiohttp middleware admitting guarded requests that carry one of ``keys``."""

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith(GUARDED):
            return await handler(request)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return _refusal("You didn't provide an API key: send it as 'Authorization: "
                            "Bearer <key>'.")
        candidate = given.strip().encode()
        # compare with every key, always: the time taken does not tell which one is close
        if not sum(hmac.compare_digest(candidate, key) for key in keys):
            return _refusal("Incorrect API key provided.")
        return await handler(request)

    return check_api_key
