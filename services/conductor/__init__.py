"""The conductor: global scheduler, worker registry, SLO admission."""
from __future__ import annotations

from typing import Optional

from common.service import service_main


def main(argv: Optional[list[str]] = None) -> int:
    from services.conductor.service import run

    return service_main("conductor", run, argv)
