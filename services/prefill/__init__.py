"""The prefill worker: chunked, layer-wise prefill with KV streamed to decode workers."""
from __future__ import annotations

from typing import Optional

from common.service import service_main


def main(argv: Optional[list[str]] = None) -> int:
    from services.prefill.service import run

    return service_main("prefill", run, argv)
