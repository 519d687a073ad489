"""The colocated worker: chunked prefill and decode in the same steps on one engine."""
from __future__ import annotations

from typing import Optional

from common.service import service_main


def main(argv: Optional[list[str]] = None) -> int:
    from services.colocated.service import run

    return service_main("colocated", run, argv)
