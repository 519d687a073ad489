"""What the conductor tells the router about the cluster, every heartbeat interval.

``ClusterStatus`` says whether the cluster can take requests and which conductor
incarnation speaks (the router stops waiting for a predecessor's requests), and carries
the view the router serves at /debug/pools, /debug/dashboard and in ``crescent status``:
each worker's load (``InstanceStatus``), the conductor's totals (``ConductorTotals``), the
global KV pool's usage (``StoreUsage``) and the prefills done since the last status
(``PrefillSummary``). The rest of the control wire is in common/protocol.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from common.ipc import message


@dataclass(frozen=True)
class InstanceStatus:
    """One live worker as the conductor sees it (served by the router at /debug/pools)."""

    instance_id: str
    role: str
    total_blocks: int
    free_blocks: int
    used_blocks: int
    queued: int
    running: int
    assigned: int  # requests placed on it and not yet finished
    queued_tokens: int = 0  # prefill: uncached prompt tokens still to compute
    context_tokens: int = 0  # decode: sum of the contexts in its batch
    cached_blocks: int = 0  # keys in its local prefix cache (from its KV events)
    draining: bool = False
    heartbeat_age_s: float = 0.0  # since its last heartbeat (or registration)


@dataclass(frozen=True)
class StoreUsage:
    """The global KV pool: the store master's last ``StoreStats`` answer, summed over its
    nodes, and the conductor's copy of its keys (the global prefix index)."""

    nodes: int
    objects: int
    dram_used: int
    dram_capacity: int
    ssd_used: int
    ssd_capacity: int
    counters: dict[str, int]  # the master's, cumulative: hits, misses, evicted, offloaded, ...
    age_s: float  # since that answer
    index_keys: int = 0
    index_state: str = ""  # the index's sync state: "live" | "resyncing" | "waiting"


@dataclass(frozen=True)
class ConductorTotals:
    """What the conductor counted since it started (the sums of its /metrics counters)."""

    placed: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # at admission (429), by reason
    failed: dict[str, int] = field(default_factory=dict)  # admitted, then failed, by reason
    prompt_tokens: int = 0
    cached_tokens: int = 0  # reused from a cache, local or global
    global_hit_tokens: int = 0  # of those, loaded from the store
    transfer_bytes: int = 0  # KV moved prefill → decode
    transfers: int = 0  # prefills that moved it
    transfer_seconds: float = 0.0  # their KV streams in flight, summed (overlaps compute)


@dataclass(frozen=True)
class PrefillSummary:
    """One request's prefill as its worker reported it (``PrefillDone``): the figures of
    the dashboard's request timeline (services/router/dashboard_log.py)."""

    request_id: str
    prefill_s: float  # the request's share of prefill compute
    wait_s: float  # the prefill blocked on transfers
    transfer_s: float  # its KV stream in flight (overlaps compute)
    transfer_bytes: int


@message
class ClusterStatus:
    """Conductor → router, every heartbeat interval: readiness and per-instance load.
    ``conductor_epoch`` names the conductor's incarnation: a new one knows nothing of the
    requests its predecessor accepted (the router stops waiting for those). ``totals``,
    ``store`` and ``prefills`` feed the router's dashboard; None (empty) from a conductor
    that sends none (``store``: also no store, or no answer from its master yet).
    ``prefills``: the requests whose ``PrefillDone`` came since the previous status."""

    ready: bool
    instances: list[InstanceStatus]
    conductor_epoch: int = 0
    totals: Optional[ConductorTotals] = None
    store: Optional[StoreUsage] = None
    prefills: list[PrefillSummary] = field(default_factory=list)
