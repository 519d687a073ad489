"""The store master's invariants, checked after every step in tests (and on demand)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from services.store_master.replica import DRAM, SSD, ReplicaState as S

if TYPE_CHECKING:
    from services.store_master.metadata import StoreMetadata
    from services.store_master.objects import StoreObject


def check_metadata(md: "StoreMetadata") -> None:
    """Every DRAM replica owns exactly one allocation; usage counters add up; replica states
    fit together (see ``check_object``); every deadline has its timer."""
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
                offloading += obj.size if rep.state is S.OFFLOADING else 0
        assert owned == dict(node.allocator.used_ranges()), "allocations ≠ replicas"
        assert ssd == node.ssd_used, f"ssd_used {node.ssd_used} ≠ {ssd}"
        assert offloading == node.offloading_bytes, "offloading_bytes drifted"
    timers = set(md.timers)
    for obj in md.objects.values():
        check_object(obj)
        for rep in obj.replicas:  # reap sees every deadline (StoreMetadata.arm)
            assert rep.deadline is None or (rep.deadline, obj.key) in timers, (
                f"{obj.key}: a deadline without its timer")


def check_object(obj: "StoreObject") -> None:
    """At most one replication in flight; an incomplete object is all DRAM WRITING and a
    complete one has none; an OFFLOADING DRAM copy and an SSD copy being written come in
    pairs on one node; a PROMOTING copy reads a READY SSD copy on its node."""
    key, reps = obj.key, obj.replicas
    assert reps, f"{key}: object without replicas"
    nodes = [(r.node_id, r.tier) for r in reps]
    assert len(nodes) == len(set(nodes)), f"{key}: duplicate replicas"
    assert all(r.state is not S.DROPPED for r in reps), f"{key}: a dropped replica kept"
    assert sum(r.state is S.REPLICATING for r in reps) <= 1, f"{key}: two replications"
    writing = [r.tier == DRAM and r.state is S.WRITING for r in reps]
    assert all(writing) if not obj.complete else not any(writing), f"{key}: put state"
    offloading = {r.node_id for r in reps if r.state is S.OFFLOADING}
    ssd_writing = {r.node_id for r in reps if r.tier == SSD and r.state is S.WRITING}
    assert offloading == ssd_writing, f"{key}: offload without its SSD copy (or back)"
    for rep in reps:
        if rep.state is S.PROMOTING:
            ssd = obj.replica(rep.node_id, SSD)
            assert ssd is not None and ssd.state is S.READY, f"{key}: promotion from nothing"
