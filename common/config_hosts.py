"""Where each process of a cluster runs: the roles, and the ``[hosts]`` table of its config
(common/config.py ``ClusterConfig.address`` reads it; docs/multihost.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

SINGLE_ROLES = ("router", "conductor", "store_master")
INDEXED_ROLES = ("prefill", "decode", "store_node", "colocated")


@dataclass
class HostsConfig:
    """The ``[hosts]`` table: the address of each process that does not run on ``host``.
    A singleton role takes one address; an indexed role a list, one per process index
    (a shorter list leaves the rest on ``host``). The routers (``routers``) take either:
    one address for all of them, or a list, one per router (each router its own pod or
    machine behind one load balancer). Addresses are IPv4 or DNS names."""

    router: Union[str, list[str], None] = None
    conductor: Optional[str] = None
    store_master: Optional[str] = None
    prefill: list[str] = field(default_factory=list)  # by process index (prefill_place)
    decode: list[str] = field(default_factory=list)
    store_node: list[str] = field(default_factory=list)
    colocated: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for role in SINGLE_ROLES:
            value = getattr(self, role)
            if role == "router" and isinstance(value, list):  # one address per router
                ok = bool(value) and all(map(is_address, value))
            else:
                ok = value is None or is_address(value)
            if not ok:
                also = ", or a list of addresses, one per router" if role == "router" else ""
                raise ValueError(f"[hosts] {role} must be one address (a non-empty string)"
                                 f"{also}, not {value!r}")
        for role in INDEXED_ROLES:
            value = getattr(self, role)
            if not isinstance(value, list) or not all(map(is_address, value)):
                raise ValueError(f"[hosts] {role} must be a list of addresses (non-empty "
                                 f"strings, one per process index), not {value!r}")


def is_address(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip()) and value == value.strip()
