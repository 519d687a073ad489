"""The store master's invariants, checked after every step in tests (and on demand)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from common.store.objects import DRAM, SSD

if TYPE_CHECKING:
    from common.store.metadata import StoreMetadata


def check_metadata(md: "StoreMetadata") -> None:
    """Every DRAM replica owns exactly one allocation; usage counters add up; at most one
    replication per object is in flight; no object is without replicas."""
    for node in md.nodes.values():
        node.allocator.check_integrity()
        owned = {}
        ssd = 0
        offloading = 0
        for obj in md.objects.values():
            for rep in obj.replicas:
                if rep.node_id != node.node_id:
                    continue
                if rep.tier == SSD:
                    ssd += obj.size
                    continue
                assert rep.offset not in owned, f"two replicas at {rep.offset}"
                owned[rep.offset] = node.allocator.round(obj.size)
                offloading += obj.size if rep.busy and rep.ready else 0
        assert owned == dict(node.allocator.used_ranges()), "allocations ≠ replicas"
        assert ssd == node.ssd_used, f"ssd_used {node.ssd_used} ≠ {ssd}"
        assert offloading == node.offloading_bytes, "offloading_bytes drifted"
    for obj in md.objects.values():
        nodes = [(r.node_id, r.tier) for r in obj.replicas]
        assert len(nodes) == len(set(nodes)), f"{obj.key}: duplicate replicas"
        copies = [r for r in obj.replicas if r.source is not None]
        assert len(copies) <= 1, f"{obj.key}: two replications in flight"
        assert all(r.tier == DRAM and r.busy and not r.ready for r in copies)
        assert obj.replicas, f"{obj.key}: object without replicas"
