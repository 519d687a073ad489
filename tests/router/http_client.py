"""A tiny stdlib HTTP client for router tests (status, headers, JSON, SSE events)."""
from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Any, Optional, Union
from urllib.parse import urlsplit


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[Union[dict, str]]:
        """SSE ``data:`` payloads in order: dicts, and the string ``"[DONE]"``."""
        out: list[Union[dict, str]] = []
        for block in self.body.decode().split("\n\n"):
            if not block:
                continue
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        return out


def connect(url: str, timeout: float = 10.0) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def request(url: str, method: str, path: str, body: Optional[Any] = None,
            raw: Optional[bytes] = None, timeout: float = 10.0,
            headers: Optional[dict[str, str]] = None) -> Reply:
    conn = connect(url, timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None
                                            else None)
        sent = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers={**sent, **(headers or {})})
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def post(url: str, path: str, body: Any, timeout: float = 10.0) -> Reply:
    return request(url, "POST", path, body=body, timeout=timeout)


def get(url: str, path: str) -> Reply:
    return request(url, "GET", path)
