"""The decode worker: continuous batching over KV received from prefill workers."""
from __future__ import annotations

from typing import Optional

from common.service import service_main


def main(argv: Optional[list[str]] = None) -> int:
    from services.decode.service import run

    return service_main("decode", run, argv)
