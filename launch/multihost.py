"""A cluster spread over the hosts of a network-namespace test bed (launch/netns.py).

Each process starts as an operator would start it on its own machine, ``crescent serve
ROLE --index I --config F``, inside the namespace that holds its ``[hosts]`` address
(``ClusterConfig.address``). Everything else (start order, CPU plan, logs, supervision,
kill, stop) is LocalCluster's. The caller's namespace has no address on the bed, so the
health check and every client call run inside the router's host (``call``).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from launch.cluster import ClusterError, LocalCluster
from launch.netns import TestBed

T = TypeVar("T")


class NetnsCluster(LocalCluster):
    def __init__(self, config_path: Optional[str], log_dir: str | Path, bed: TestBed) -> None:
        super().__init__(config_path, log_dir)
        self.bed = bed
        self.placement: dict[tuple[str, int], str] = {}  # (role, index) → bed host
        for role, index in self.plan():
            address = self.config.address(role, index)
            try:
                self.placement[role, index] = bed.host_of(address)
            except KeyError:
                raise ClusterError(f"{role}-{index} is at {address!r}, which no host of the "
                                   f"bed has ({bed.addresses}); set it in [hosts]") from None

    def host(self, role: str, index: int = 0) -> str:
        """The bed host ``role``-``index`` runs on."""
        return self.placement[role, index]

    def command(self, role: str, index: int) -> list[str]:
        cmd = [sys.executable, "-m", "launch.cli", "serve", role]
        return self.bed.argv(self.host(role, index), cmd + self.service_args(role, index))

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` from the router's host (where clients reach ``url``)."""
        return self.bed.call(self.host("router"), fn, *args, **kwargs)

    def healthy(self) -> bool:
        return self.call(super().healthy)
