"""Eviction and the SSD tier: which DRAM copies leave, where they go, how they come back.

Policy helpers of ``StoreMetadata`` (pure; ``now`` passed in). A node about to cross its
``high_watermark`` evicts its least recently used complete, unleased READY copies until
``evict_fraction`` of its capacity is freed; with SSD room an evicted copy is offloaded
(DRAM READY → OFFLOADING, a new SSD copy WRITING) instead of dropped. A get of an object
only on SSD promotes it: a new DRAM copy PROMOTING on the node whose SSD holds it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from services.store_master.objects import NodeCommand, NodeState, StoreObject
from services.store_master.replica import DRAM, SSD, Replica, ReplicaState as S

if TYPE_CHECKING:
    from services.store_master.metadata import StoreMetadata


def evict(md: StoreMetadata, node: NodeState, now: float,
          spare: Optional[StoreObject] = None) -> bool:
    """Free ``evict_fraction`` of the node's DRAM, LRU first; ``spare``: an object whose
    SSD copy is about to be promoted, never pushed off the SSD to make room. False: fewer
    unleased READY copies than that (until time passes or puts commit, a second scan finds
    none more). The scan stops at its target and copies no key list: it is linear in the
    objects it passes over, and only when the store is short of evictable copies."""
    target = md.config.evict_fraction * node.capacity
    freed = 0
    victims: list[tuple[StoreObject, Replica]] = []
    for obj in md.objects.values():  # oldest use first; dropped after the scan
        if freed >= target:
            break
        if not obj.complete or obj.leased(now):
            continue
        rep = obj.replica(node.node_id, DRAM)
        if rep is None or rep.state is not S.READY:
            continue
        freed += node.allocator.round(obj.size)
        victims.append((obj, rep))
    for obj, rep in victims:
        md.counters["evicted"] += 1
        if not start_offload(md, node, obj, rep, now, spare):
            md.drop_replica(obj, rep)
    return freed >= target


def start_offload(md: StoreMetadata, node: NodeState, obj: StoreObject, rep: Replica,
                  now: float, spare: Optional[StoreObject] = None) -> bool:
    if obj.replica(node.node_id, SSD) is not None:
        return False  # already on this node's SSD: just drop the DRAM copy
    if not node.ssd_capacity or not ssd_room(md, node, obj.size, now, spare):
        return False
    node.ssd_used += obj.size
    node.offloading_bytes += obj.size
    rep.move(S.OFFLOADING, now + md.config.put_timeout_s)
    md.arm(obj.key, now + md.config.put_timeout_s)
    obj.replicas.append(Replica(node.node_id, SSD, S.WRITING))
    md.commands.append(NodeCommand(node.node_id, "offload", obj.key, rep.offset or 0,
                                   obj.size))
    return True


def ssd_room(md: StoreMetadata, node: NodeState, size: int, now: float,
             spare: Optional[StoreObject] = None) -> bool:
    """Make room on a node's SSD by dropping its least recently used SSD copies."""
    if size > node.ssd_capacity:
        return False
    short = node.ssd_used + size - node.ssd_capacity
    drops: list[tuple[StoreObject, Replica]] = []
    for obj in md.objects.values():  # oldest use first; dropped after the scan
        if short <= 0:
            break
        rep = obj.replica(node.node_id, SSD)
        if rep is None or rep.state is not S.READY or obj.leased(now):
            continue
        if obj is spare or promoting_from(obj, node.node_id):
            continue  # being (or about to be) read in
        drops.append((obj, rep))
        short -= obj.size
    for obj, rep in drops:
        md.drop_replica(obj, rep)
    return node.ssd_used + size <= node.ssd_capacity


def start_promotion(md: StoreMetadata, obj: StoreObject, now: float) -> bool:
    """Copy an SSD-only object back into DRAM on a node whose SSD holds it."""
    for ssd in obj.replicas:
        if ssd.tier != SSD or ssd.state is not S.READY:
            continue
        node = md.nodes.get(ssd.node_id)
        if node is None or obj.replica(node.node_id, DRAM) is not None:
            continue
        offset = md.allocate(node, obj.size, now, spare=obj)
        if offset is None:
            continue
        obj.replicas.append(Replica(node.node_id, DRAM, S.PROMOTING, offset,
                                    deadline=now + md.config.put_timeout_s))
        md.arm(obj.key, now + md.config.put_timeout_s)
        md.commands.append(NodeCommand(node.node_id, "promote", obj.key, offset, obj.size))
        return True
    return False


def promoting_from(obj: StoreObject, node_id: str) -> bool:
    """Whether this node's SSD copy of ``obj`` is being read into its DRAM."""
    dram = obj.replica(node_id, DRAM)
    return dram is not None and dram.state is S.PROMOTING
