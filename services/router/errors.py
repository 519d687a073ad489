"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

import math
from typing import Optional

import orjson
from aiohttp import web

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
          503: "service_unavailable", 504: "timeout_error"}


class ApiError(Exception):
    """An error the client sees as an OpenAI error body with an HTTP status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, error_type: Optional[str] = None,
                 retry_after_s: Optional[float] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPES.get(status, "internal_error")
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return web.Response(status=self.status, body=orjson.dumps(self.body()),
                            content_type="application/json", headers=headers)


def invalid(message: str, param: Optional[str] = None,
            code: Optional[str] = None) -> ApiError:
    """A 400 ``invalid_request_error``."""
    return ApiError(400, message, param=param, code=code)
