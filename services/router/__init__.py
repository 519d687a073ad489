"""The router: OpenAI-compatible HTTP API, tokenization, SSE streaming (see docs/api.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from common.config import ClusterConfig


def main(argv: Optional[list[str]] = None) -> int:
    from services.router.app import main as _main

    return _main(argv)


async def run(config: ClusterConfig, index: int = 0) -> None:
    from services.router.app import run as _run

    await _run(config, index)
