"""Hot objects get more replicas: reads counted in a sliding window, one copy at a time.

Policy helpers of ``StoreMetadata`` (pure; ``now`` passed in). When an object has been read
at least ``hot_read_threshold`` × (its DRAM replicas) times within ``hot_window_s`` and has
fewer than ``max_replicas`` DRAM replicas, the least used live node not holding it that
stays under ``high_watermark`` (a replication never evicts) gets a REPLICATING copy and a
``replicate`` command; the object is pinned (as if leased) until the copy is answered.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from services.store_master.objects import NodeCommand, StoreObject
from services.store_master.replica import DRAM, Replica, ReplicaState

if TYPE_CHECKING:
    from services.store_master.metadata import StoreMetadata


def count_read(md: StoreMetadata, obj: StoreObject, now: float) -> None:
    """Record a read; start a replication when the object is hot enough."""
    cfg = md.config
    if cfg.hot_read_threshold <= 0:
        return
    dram = [r for r in obj.replicas if r.tier == DRAM]
    if len(dram) >= cfg.max_replicas:
        obj.reads = None
        return
    recent = obj.note_read(now, cfg.hot_window_s, cfg.hot_read_threshold * cfg.max_replicas)
    if recent < cfg.hot_read_threshold * len(dram) or obj.replicating() is not None:
        return
    if start_replication(md, obj, now) and obj.reads is not None:
        obj.reads.clear()  # the next copy needs fresh evidence


def start_replication(md: StoreMetadata, obj: StoreObject, now: float) -> bool:
    sources = [r for r in obj.ready_dram() if r.node_id in md.nodes]
    if not sources:
        return False
    holding = {r.node_id for r in obj.replicas}
    limit = md.config.high_watermark
    for node in sorted(md.nodes.values(), key=lambda n: n.pressure_bytes()):
        if node.node_id in holding:
            continue
        if node.pressure_bytes() + node.allocator.round(obj.size) > limit * node.capacity:
            continue  # a replica never evicts anything
        offset = node.allocator.allocate(obj.size)
        if offset is None:
            continue
        source = sources[0]
        obj.replicas.append(Replica(node.node_id, DRAM, ReplicaState.REPLICATING, offset,
                                    deadline=now + md.config.put_timeout_s,
                                    source=source.node_id))
        md.arm(obj.key, now + md.config.put_timeout_s)
        md.commands.append(NodeCommand(node.node_id, "replicate", obj.key, offset,
                                       obj.size, source.node_id, source.offset or 0))
        return True
    return False
