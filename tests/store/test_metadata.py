from __future__ import annotations

from hypothesis import given, settings, strategies as st

from services.store_master.metadata import MetadataConfig, PutSlot, StoreMetadata

B = 1024  # one block


def make(nodes: int = 1, capacity: int = 10 * B, ssd: int = 0, **kw) -> StoreMetadata:
    """Grants last exactly their base times here (no per-byte share) unless ``kw`` sets
    ``min_bytes_per_s``."""
    kw = {"min_bytes_per_s": float("inf")} | kw
    cfg = MetadataConfig(put_timeout_s=10.0, lease_s=5.0, high_watermark=0.9,
                         evict_fraction=0.2, heartbeat_timeout_s=3.0, **kw)
    md = StoreMetadata(cfg)
    for i in range(nodes):
        md.add_node(f"n{i}", capacity, ssd, {"session_id": f"s{i}"}, now=0.0)
    return md


def put(md: StoreMetadata, keys: list[str], now: float = 0.0, replicas: int = 1) -> list[PutSlot]:
    slots = md.put_start(keys, B, replicas, now)
    md.put_end([k for k, s in zip(keys, slots) if s.status == "new"],
               [True] * sum(s.status == "new" for s in slots), now)
    md.check_integrity()
    return slots


def test_two_phase_put_visibility_and_events():
    md = make()
    slots = md.put_start(["a", "b"], B, 1, now=0.0)
    assert slots == [PutSlot("new", (("n0", 0),)), PutSlot("new", (("n0", B),))]
    assert md.exists(["a", "b"]) == [False, False]
    assert md.get(["a"], now=0.0) == ([None], [])
    assert md.put_start(["a"], B, 1, now=0.0) == [PutSlot("exists")]  # in flight
    assert md.put_end(["a", "b"], [True, False], now=1.0) == [True, False]
    assert md.exists(["a", "b"]) == [True, False]
    assert md.get(["a", "b"], now=1.0) == ([[("n0", 0)], None], [])
    assert [(e.seq, e.kind, e.key) for e in md.events.since(0)] == [(1, "stored", "a")]
    assert md.nodes["n0"].allocator.used_bytes == B  # the abandoned put gave its space back
    md.check_integrity()


def test_zombie_put_reclaimed_after_timeout():
    md = make()
    md.put_start(["z"], B, 1, now=0.0)
    md.heartbeat("n0", 9.9)
    assert md.reap(now=9.9) == ([], 0)
    md.heartbeat("n0", 9.9)
    assert md.reap(now=10.0) == ([], 1)
    assert md.nodes["n0"].allocator.used_bytes == 0
    assert md.put_end(["z"], [True], now=10.5) == [False]  # too late: never visible
    assert md.exists(["z"]) == [False]
    assert md.events.since(0) == []
    md.check_integrity()


def test_reap_looks_only_at_objects_whose_timers_are_due():
    """Each deadline arms a timer; a tick pops the due ones and checks what their objects
    hold now: a committed put's timer finds nothing to do, a key put again after it was
    reclaimed is judged by its new deadline, and no timer outlives its deadline."""
    md = make()
    md.put_start(["a", "b"], B, 1, now=0.0)  # timers at 10.0
    md.put_end(["a"], [True], now=1.0)
    md.put_start(["c"], B, 1, now=4.0)  # 14.0
    assert sorted(md.timers) == [(10.0, "a"), (10.0, "b"), (14.0, "c")]
    md.heartbeat("n0", 9.9)
    assert md.reap(now=9.9) == ([], 0) and len(md.timers) == 3
    md.heartbeat("n0", 10.0)
    assert md.reap(now=10.0) == ([], 1)  # b; a was committed
    assert md.exists(["a", "b"]) == [True, False] and md.timers == [(14.0, "c")]
    md.put_start(["b"], B, 1, now=12.0)  # b again, until 22.0
    md.heartbeat("n0", 14.0)
    assert md.reap(now=14.0) == ([], 1)  # c; the new b is not due
    assert md.timers == [(22.0, "b")] and "b" in md.objects
    md.check_integrity()


def test_grants_count_their_bytes():
    """A put's deadline and a get's lease add the request's bytes at min_bytes_per_s: two
    blocks at one block per second are 2 s more; a get leases only what it found."""
    md = make(min_bytes_per_s=float(B))
    md.put_start(["a", "b"], B, 1, now=0.0)  # 10 s + 2 s
    md.heartbeat("n0", 11.9)
    assert md.reap(now=11.9) == ([], 0)
    md.heartbeat("n0", 11.9)
    assert md.reap(now=12.0) == ([], 2)
    put(md, ["c"], now=20.0)
    assert md.grant_s(5.0, md.complete_bytes(["c", "missing"])) == 6.0
    md.get(["c", "missing"], now=21.0)  # lease until 27.0, not 26.0
    assert md.remove(["c"], now=26.5) == 0
    assert md.remove(["c"], now=27.1) == 1
    md.check_integrity()


def test_lease_blocks_remove_and_eviction():
    md = make()
    put(md, ["a", "b"])
    md.get(["a"], now=1.0)  # lease until 6.0
    assert md.remove(["a", "b"], now=2.0) == 1
    assert md.exists(["a", "b"]) == [True, False]
    assert md.remove(["a"], now=6.0) == 1
    assert [(e.kind, e.key) for e in md.events.since(0)][-2:] == [("removed", "b"),
                                                                  ("removed", "a")]
    md.check_integrity()


def test_eviction_lru_order_watermark_and_fraction():
    md = make()
    put(md, [f"k{i}" for i in range(9)])  # 90 %: at the watermark, not above it
    assert md.counters["evicted"] == 0
    md.get(["k0"], now=100.0)  # k0 becomes most recent (its lease expires at 105)
    put(md, ["k9"], now=200.0)  # would exceed 90 %: evict 20 % = 2 blocks, LRU first
    assert md.exists([f"k{i}" for i in range(10)]) == [True, False, False] + [True] * 7
    assert md.counters["evicted"] == 2
    removed = [e.key for e in md.events.since(0) if e.kind == "removed"]
    assert removed == ["k1", "k2"]


def test_eviction_skips_leased_and_in_flight():
    md = make()
    md.put_start(["w"], B, 1, now=0.0)  # in flight, oldest
    put(md, [f"k{i}" for i in range(8)])
    md.get(["k0", "k1"], now=50.0)  # leased until 55
    put(md, ["x"], now=51.0)
    assert md.exists(["k0", "k1", "k2", "k3", "k4"]) == [True, True, False, False, True]
    assert "w" in md.objects and not md.objects["w"].complete


def test_a_put_into_a_store_of_leased_copies_scans_for_victims_once(monkeypatch):
    """Nothing evictable (every copy leased): the put is placed in the room above the
    watermark, then refused, with one eviction scan per node for the whole call, not one
    per key (1,024 keys into 10,240 leased objects took 4-9 s)."""
    from services.store_master import tiers

    md = make(nodes=2, capacity=10 * B)
    put(md, [f"k{i}" for i in range(18)])  # 90 % of both nodes
    md.get([f"k{i}" for i in range(18)], now=1.0)  # all leased until 6
    scans: list[str] = []
    real = tiers.evict

    def counted(md_, node, *rest, **kw):
        scans.append(node.node_id)
        return real(md_, node, *rest, **kw)

    monkeypatch.setattr(tiers, "evict", counted)
    slots = put(md, [f"x{i}" for i in range(6)], now=2.0)
    assert [s.status for s in slots] == ["new"] * 2 + ["nospace"] * 4
    assert sorted(scans) == ["n0", "n1"] and md.counters["evicted"] == 0
    scans.clear()  # the next call scans again: by then copies may have become evictable
    put(md, ["y"], now=7.0)  # leases over: evicts 20 % of the node it lands on
    assert scans and md.counters["evicted"] == 2


def test_replicas_on_distinct_nodes():
    md = make(nodes=3)
    slots = put(md, ["a", "b"], replicas=2)
    for slot in slots:
        assert len({n for n, _ in slot.locations}) == 2
    (slot,) = put(md, ["c"], replicas=5)
    assert sorted(n for n, _ in slot.locations) == ["n0", "n1", "n2"]
    # placement spreads: the least used nodes first
    assert {n for n, _ in slots[0].locations} | {n for n, _ in slots[1].locations} == \
        {"n0", "n1", "n2"}


def test_dead_node_dropped_after_heartbeat_timeout():
    md = make(nodes=2)
    put(md, ["both"], replicas=2)
    md.put_start(["only0"], B, 1, now=0.0)  # goes to the least used node
    node_of_only0 = md.objects["only0"].replicas[0].node_id
    other = "n1" if node_of_only0 == "n0" else "n0"
    md.put_end(["only0"], [True], now=0.0)
    md.heartbeat(other, now=2.5)
    assert md.reap(now=3.0) == ([], 0)
    md.get(["only0"], now=3.0)  # a lease does not keep a dead node's replica
    assert md.reap(now=3.5) == ([node_of_only0], 0)
    assert md.exists(["both", "only0"]) == [True, False]
    assert md.get(["both"], now=3.5)[0] == [[(other, md.objects["both"].replicas[0].offset)]]
    assert md.heartbeat(node_of_only0, now=4.0) is False  # it must re-register
    md.check_integrity()


def test_ssd_offload_and_promotion_round_trip():
    md = make(ssd=4 * B)
    put(md, [f"k{i}" for i in range(10)])
    assert md.drain_commands() == []
    put(md, ["k10"], now=1.0)  # k0, k1 evicted: offloaded, not dropped
    cmds = md.drain_commands()
    assert [(c.kind, c.key, c.offset) for c in cmds] == [("offload", "k0", 0),
                                                       ("offload", "k1", B)]
    md.check_integrity()
    for c in cmds:
        md.offload_done("n0", c.key, True, now=1.5)
    md.check_integrity()
    assert md.nodes["n0"].ssd_used == 2 * B
    assert md.exists(["k0", "k1"]) == [True, True]  # still visible, on SSD
    locs, promoting = md.get(["k0", "k2"], now=2.0)
    assert locs[0] is None and promoting == [0] and locs[1] == [("n0", 2 * B)]
    (cmd,) = md.drain_commands()
    assert (cmd.kind, cmd.key) == ("promote", "k0")
    md.promote_done("n0", "k0", True)
    locs, promoting = md.get(["k0"], now=2.1, promote=False)
    assert locs == [[("n0", cmd.offset)]] and promoting == []
    assert md.counters["promoted"] == 1 and md.counters["offloaded"] == 2
    md.check_integrity()


def test_ssd_full_drops_oldest_ssd_copy():
    md = make(ssd=2 * B)
    put(md, [f"k{i}" for i in range(10)])
    put(md, ["a"], now=1.0)
    for c in md.drain_commands():
        md.offload_done("n0", c.key, True, now=1.0)
    put(md, ["b", "c"], now=2.0)  # evicts k2, k3 to SSD: k0, k1 leave the SSD
    cmds = [(c.kind, c.key) for c in md.drain_commands()]
    assert ("drop_ssd", "k0") in cmds and ("offload", "k3") in cmds
    assert md.exists(["k0", "k1", "k2", "k3"]) == [False, False, True, True]
    md.check_integrity()


def test_promotion_never_pushes_its_own_source_off_the_ssd():
    md = make(ssd=B)  # room for one SSD copy
    put(md, [f"k{i}" for i in range(9)])  # 90 %
    put(md, ["k9"], now=1.0)  # k0 offloaded; k1 dropped (the SSD is busy being written)
    assert [(c.kind, c.key) for c in md.drain_commands()] == [("offload", "k0")]
    md.offload_done("n0", "k0", True, now=1.5)
    put(md, ["k10"], now=2.0)  # 90 % again: k0 only on SSD
    # promoting k0 needs DRAM: k2, k3 are evicted, and the SSD has room only if k0's copy
    # left it, so they are dropped instead of offloaded; k0's copy stays to be read in
    assert md.get(["k0"], now=3.0) == ([None], [0])
    assert [(c.kind, c.key) for c in md.drain_commands()] == [("promote", "k0")]
    assert md.exists(["k0", "k1", "k2", "k3", "k4"]) == [True, False, False, False, True]
    md.promote_done("n0", "k0", True)
    assert md.get(["k0"], now=3.1, promote=False)[0] == [[("n0", 2 * B)]]
    md.check_integrity()


def test_late_answers_change_nothing():
    md = make(ssd=4 * B)
    put(md, [f"k{i}" for i in range(10)])
    put(md, ["k10"], now=1.0)  # k0, k1 offloading until 11.0
    md.drain_commands()
    md.heartbeat("n0", 11.0)
    md.reap(now=11.0)  # unanswered: the DRAM copies stay, the SSD copies go
    assert [(c.kind, c.key) for c in md.drain_commands()] == [("drop_ssd", "k0"),
                                                           ("drop_ssd", "k1")]
    md.offload_done("n0", "k0", True, now=11.5)  # too late: nothing to drop DRAM for
    md.promote_done("n0", "k1", True)  # no promotion was asked for
    assert md.get(["k0", "k1"], now=12.0)[0] == [[("n0", 0)], [("n0", B)]]
    assert md.counters["offloaded"] == md.counters["promoted"] == 0
    assert md.nodes["n0"].ssd_used == 0
    md.check_integrity()


def hot(md: StoreMetadata, key: str, reads: int, now: float = 1.0) -> list:
    """``reads`` gets of ``key`` 0.1 s apart; returns the replicate commands they queued."""
    for i in range(reads):
        md.get([key], now + 0.1 * i)
    return [c for c in md.drain_commands() if c.kind == "replicate"]


def test_hot_object_gets_exactly_one_replica_on_another_node():
    md = make(nodes=3)
    put(md, ["cold", "h"])  # least used first: "cold" on n0, "h" on n1
    src = md.objects["h"].replicas[0]
    assert src.node_id == "n1"
    assert hot(md, "h", 3) == []  # below the threshold (4 reads in 10 s)
    (cmd,) = hot(md, "h", 1, now=1.3)  # the 4th read crosses it: exactly one command
    assert (cmd.node_id, cmd.key, cmd.size, cmd.source_node, cmd.source_offset) == \
        ("n2", "h", B, "n1", src.offset)  # n2: the least used node not holding "h"
    md.check_integrity()
    # in flight: invisible to readers, not removable, not evictable, one copy at a time
    assert md.get(["h"], now=2.0)[0] == [[("n1", src.offset)]]
    assert hot(md, "h", 8, now=2.0) == []
    assert md.remove(["h"], now=100.0) == 0
    assert md.nodes["n2"].allocator.used_bytes == B
    assert md.replicate_done("n2", "h", cmd.offset + 64, True) is False  # not this replica
    assert md.replicate_done("n2", "h", cmd.offset, True) is True
    assert md.counters["replications"] == 1
    md.check_integrity()
    # readers now get both copies, alternating which comes first
    firsts = [md.get(["h"], now=3.0 + i)[0][0][0][0] for i in range(4)]
    assert sorted(firsts) == ["n1", "n1", "n2", "n2"] and firsts[0] != firsts[1]
    assert all(len(md.get(["h"], now=4.0)[0][0]) == 2 for _ in range(2))
    assert hot(md, "h", 20, now=5.0) == []  # max_replicas = 2: no more copies
    assert md.replicate_done("n2", "h", cmd.offset, True) is False  # a duplicate answer
    assert md.counters["replications"] == 1
    md.check_integrity()


def test_reads_outside_the_window_are_not_hot():
    md = make(nodes=2)
    put(md, ["h"])
    for t in (1.0, 6.0, 11.5, 17.0, 22.5):  # never 4 reads within 10 s
        md.get(["h"], now=t)
    assert md.drain_commands() == []
    assert hot(md, "h", 3, now=23.0) != []  # 22.5 + three more: hot


def test_failed_or_timed_out_replication_frees_space():
    md = make(nodes=2)
    put(md, ["h"])
    (cmd,) = hot(md, "h", 4)
    other = cmd.node_id
    assert md.nodes[other].allocator.used_bytes == B
    assert md.replicate_done(other, "h", cmd.offset, False) is False
    assert md.nodes[other].allocator.used_bytes == 0
    assert md.counters["replications_failed"] == 1
    assert [r.node_id for r in md.objects["h"].replicas] == [md.objects["h"].replicas[0].node_id]
    md.check_integrity()
    (cmd,) = hot(md, "h", 4, now=2.0)  # hot again (sent at 2.3); this one is never answered
    for n in md.nodes:
        md.heartbeat(n, 12.2)
    md.reap(now=12.2)
    assert md.nodes[other].allocator.used_bytes == B
    for n in md.nodes:
        md.heartbeat(n, 12.3)
    md.reap(now=12.3)  # put_timeout_s after the command: reclaimed like a zombie put
    assert md.nodes[other].allocator.used_bytes == 0
    assert md.counters["replications_failed"] == 2
    assert md.replicate_done(other, "h", cmd.offset, True) is False  # too late
    assert md.exists(["h"]) == [True] and len(md.objects["h"].replicas) == 1
    md.check_integrity()


def test_no_replication_without_a_node_with_room():
    md = make(nodes=1)
    md.add_node("n1", 2 * B, 0, {}, now=0.0)
    put(md, ["h"])  # on n0
    put(md, ["x"])  # on n1: one more block would put it above 90 %
    assert [md.objects[k].replicas[0].node_id for k in ("h", "x")] == ["n0", "n1"]
    assert hot(md, "h", 8) == []  # no node below the watermark: no copy, nothing evicted
    assert md.counters["evicted"] == 0 and md.exists(["x"]) == [True]
    md.check_integrity()


def test_source_death_mid_replication_keeps_the_copy_if_it_lands():
    md = make(nodes=2)
    put(md, ["h"])
    src = md.objects["h"].replicas[0].node_id
    (cmd,) = hot(md, "h", 4)
    md.heartbeat(cmd.node_id, 4.0)
    assert md.reap(now=4.0) == ([src], 0)
    assert md.exists(["h"]) == [False]  # only the unfinished copy is left: not readable
    assert md.replicate_done(cmd.node_id, "h", cmd.offset, True) is True
    assert md.get(["h"], now=4.5)[0] == [[(cmd.node_id, cmd.offset)]]
    md.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "start", "end", "get", "rm", "tick",
                                           "done"]),
                          st.integers(0, 25), st.booleans()), max_size=80))
def test_random_operations_keep_integrity(ops):
    md = make(nodes=2, capacity=8 * B, ssd=3 * B)
    now = 0.0
    for op, k, flag in ops:
        key = f"k{k}"
        now += 0.5
        if op == "put":
            md.put_start([key], B, 2 if flag else 1, now)
            md.put_end([key], [True], now)
        elif op == "start":
            md.put_start([key], B, 1, now)
        elif op == "end":
            md.put_end([key], [flag], now)
        elif op == "get":
            md.get([key], now)
        elif op == "rm":
            md.remove([key], now)
        elif op == "tick":
            md.heartbeat("n0", now)
            md.heartbeat("n1", now)
            md.reap(now)
        else:
            for c in md.drain_commands():
                if c.kind == "offload":
                    md.offload_done(c.node_id, c.key, flag, now)
                elif c.kind == "promote":
                    md.promote_done(c.node_id, c.key, flag)
                elif c.kind == "replicate":
                    md.replicate_done(c.node_id, c.key, c.offset, flag)
        md.check_integrity()
