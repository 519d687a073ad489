"""Which processes share a host: the identity behind every shared-memory fast path.

Two processes may hand bytes over through a /dev/shm file (KV prefill → decode, store node
segments, hidden states between pipeline stages) only when they run on one kernel and see
one /dev/shm. A process's identity is the kernel's boot id and the inode of its network
namespace: a reboot or another machine changes the first, a container or pod (or a
namespace of the multi-host test bed, launch/netns.py) the second. Different network
namespaces on one machine count as different hosts: conservative, since a pod's /dev/shm
is not shared, and it makes the test bed take the cross-host paths. Every process
publishes its identity when it registers; peers compare it with their own.
"""
from __future__ import annotations

import os
from functools import lru_cache

BOOT_ID = "/proc/sys/kernel/random/boot_id"
NET_NS = "/proc/self/ns/net"


def read_host_id(boot_id_path: str = BOOT_ID, netns_path: str = NET_NS) -> str:
    """``<boot id>/net:<netns inode>``; a part that cannot be read is ``unknown``, which
    still differs from every readable identity."""
    try:
        with open(boot_id_path) as fh:
            boot = fh.read().strip() or "unknown"
    except OSError:
        boot = "unknown"
    try:
        net = str(os.stat(netns_path).st_ino)
    except OSError:
        net = "unknown"
    return f"{boot}/net:{net}"


@lru_cache(maxsize=1)
def host_id() -> str:
    """This process's host identity (fixed for its life: a process does not change netns)."""
    return read_host_id()


def same_host(peer_host_id: object) -> bool:
    """True when a peer's published identity is ours (None, empty or unknown: False)."""
    return (isinstance(peer_host_id, str) and "unknown" not in peer_host_id
            and peer_host_id == host_id())
