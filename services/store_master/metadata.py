"""The store master's state machine: keys → replicas, space, leases, eviction, liveness.

Pure policy (no zmq, no torch, no clock: every verb takes ``now``). Tested in-process with
exact outcomes. Semantics (after Mooncake Store):

- Two-phase put: ``put_start`` allocates space and records an *incomplete* object;
  ``put_end`` commits it. Readers (``exists``/``get``) see only complete objects. An
  incomplete object older than ``put_timeout_s`` is a zombie and ``reap`` reclaims it.
- ``get`` grants a lease of ``lease_s``; a leased object is never evicted nor removed.
  A lease and a put's deadline also count the request's bytes at ``min_bytes_per_s``
  (``grant_s``): a 2 GB prompt's KV over TCP from GPU memory needs seconds, not a fixed 5.
- Eviction: when a put would push a node's DRAM above ``high_watermark`` of its capacity,
  the least recently used (committed or read) complete, unleased READY replicas on that node
  are evicted until ``evict_fraction`` of its capacity is freed. With an SSD tier an evicted
  replica is offloaded (a ``NodeCommand``) instead of dropped; a get of an SSD-only object
  starts a promotion back into DRAM.
- Replicas of one object are on distinct nodes. A node silent for ``heartbeat_timeout_s``
  is dropped with all its replicas.
- Hot objects get more replicas: when an object has been read at least
  ``hot_read_threshold`` × (its DRAM replicas) times within the last ``hot_window_s`` and has
  fewer than ``max_replicas`` DRAM replicas, the master allocates space on the least used
  live node not holding it (without evicting: only a node below ``high_watermark``) and
  sends that node a ``replicate`` command (copy from a ready replica's node). The new
  replica is invisible and never evicted until ``replicate_done`` commits it; the object is
  pinned (as if leased) meanwhile; a failure or ``put_timeout_s`` frees the space. Readers
  get the ready replicas rotated round-robin per read, so load spreads over the copies.

Each replica's state (WRITING, READY, OFFLOADING, PROMOTING, REPLICATING, DROPPED) and its
legal moves live in replica.py; eviction and the SSD tier in tiers.py; hot replication in
hot.py. The service reads the state only through the query verbs at the end of this class.

Deadlines are timers: every replica that gets one (``arm``) puts ``(deadline, key)`` on a
heap, and ``reap`` looks only at the objects whose timers are due, so a tick costs what
expires, not the number of objects (a scan of 50,000 objects took 21 ms, every 0.1 s).
A timer is a hint: ``reap`` checks what the object holds now (its replicas may have moved
on, or the key been forgotten and put again).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from common.store.policy import MetadataConfig
from services.store_master import hot, tiers
from services.store_master.allocator import OffsetAllocator
from services.store_master.integrity import check_metadata
from services.store_master.objects import EventLog, NodeCommand, NodeState, StoreObject
from services.store_master.replica import DRAM, SSD, Replica, ReplicaState as S

Location = tuple[str, int]  # (node_id, offset in its segment)




@dataclass(frozen=True)
class PutSlot:
    status: str  # "new" (write to locations, then put_end) | "exists" | "nospace"
    locations: tuple[Location, ...] = ()


class StoreMetadata:
    def __init__(self, config: Optional[MetadataConfig] = None) -> None:
        self.config = config or MetadataConfig()
        self.nodes: dict[str, NodeState] = {}
        self.objects: OrderedDict[str, StoreObject] = OrderedDict()  # oldest use first
        self.events = EventLog()
        self.commands: list[NodeCommand] = []  # drained by the service
        self.timers: list[tuple[float, str]] = []  # heap of (deadline, key): see ``arm``
        self.counters = {"evicted": 0, "offloaded": 0, "promoted": 0, "zombies": 0,
                         "dead_nodes": 0, "hits": 0, "misses": 0, "replications": 0,
                         "replications_failed": 0}

    # ------------------------------------------------------------------ nodes
    def add_node(self, node_id: str, capacity: int, ssd_capacity: int,
                 info: dict[str, Any], now: float) -> None:
        """Register (or re-register: the old segment's replicas are dropped)."""
        if node_id in self.nodes:
            self.remove_node(node_id)
        allocator = OffsetAllocator(capacity, self.config.alignment)
        self.nodes[node_id] = NodeState(node_id, allocator, ssd_capacity, info, now)

    def heartbeat(self, node_id: str, now: float) -> bool:
        node = self.nodes.get(node_id)
        if node is None:
            return False  # unknown (dropped or master restarted): the node re-registers
        node.last_seen = now
        return True

    def remove_node(self, node_id: str) -> None:
        """Forget a node and every replica on it, leases notwithstanding (they vanish with
        the node: nothing is left to give back, so they make no state move)."""
        if self.nodes.pop(node_id, None) is None:
            return
        for key in list(self.objects):
            obj = self.objects[key]
            obj.replicas = [r for r in obj.replicas if r.node_id != node_id]
            if not obj.replicas:
                self._forget(key)
        self.commands = [c for c in self.commands if c.node_id != node_id]

    def reap(self, now: float) -> tuple[list[str], int]:
        """Drop silent nodes, reclaim zombie puts and stale promotions: the objects whose
        timers are due (``arm``), not every object.

        Returns (dead node ids, zombie puts reclaimed)."""
        dead = [n.node_id for n in self.nodes.values()
                if now - n.last_seen > self.config.heartbeat_timeout_s]
        for node_id in dead:
            self.remove_node(node_id)
        self.counters["dead_nodes"] += len(dead)
        due: dict[str, None] = {}  # in deadline order, each key once
        while self.timers and self.timers[0][0] <= now:
            due[heapq.heappop(self.timers)[1]] = None
        zombies = 0
        for key in due:
            obj = self.objects.get(key)
            if obj is None:
                continue
            if obj.zombie(now):
                self._forget(key)
                zombies += 1
                continue
            for rep in list(obj.replicas):
                if rep.tier != DRAM or not rep.expired(now):
                    continue
                if rep.state is S.OFFLOADING:  # never answered: keep the DRAM copy
                    self.offload_done(rep.node_id, obj.key, False, now)
                elif rep.state in (S.PROMOTING, S.REPLICATING):  # never finished
                    if rep.state is S.REPLICATING:
                        self.counters["replications_failed"] += 1
                    self.drop_replica(obj, rep)
        self.counters["zombies"] += zombies
        return dead, zombies

    def arm(self, key: str, deadline: float) -> None:
        """A replica of ``key`` now waits on a node until ``deadline`` (a TIMED state of
        replica.py): ``reap`` looks at the object once that has passed. Every place that
        gives a replica a deadline calls this (``check_integrity`` holds it to that)."""
        heapq.heappush(self.timers, (deadline, key))

    # ------------------------------------------------------------------ reads
    def exists(self, keys: list[str]) -> list[bool]:
        out = []
        for key in keys:
            obj = self.objects.get(key)
            out.append(obj is not None and obj.readable())
        return out

    def grant_s(self, base_s: float, nbytes: int) -> float:
        """A lease or put grant for ``nbytes``: ``base_s`` plus their time at the slowest
        healthy rate (``min_bytes_per_s``)."""
        return base_s + nbytes / self.config.min_bytes_per_s

    def complete_bytes(self, keys: Iterable[str]) -> int:
        """Bytes of the committed objects among ``keys`` (what a get of them would lease)."""
        objs = (self.objects.get(k) for k in keys)
        return sum(o.size for o in objs if o is not None and o.complete)

    def get(self, keys: list[str], now: float,
            promote: bool = True) -> tuple[list[Optional[list[Location]]], list[int]]:
        """Ready DRAM locations per key (None: miss) and the indices whose SSD-only objects
        started a promotion (ask again with ``promote=False`` once it is done). A hit or a
        promotion grants a lease and refreshes the object's LRU position."""
        out: list[Optional[list[Location]]] = []
        promoting: list[int] = []
        objects = self.objects
        objs = [objects.get(key) for key in keys]
        nbytes = sum(o.size for o in objs if o is not None and o.complete)
        until = now + self.grant_s(self.config.lease_s, nbytes)
        # with one node no object can get another copy: reads need no counting
        count_reads = self.config.hot_read_threshold > 0 and len(self.nodes) > 1
        hits = 0
        for i, (key, obj) in enumerate(zip(keys, objs)):
            if obj is None or not obj.complete:
                out.append(None)
                continue
            dram = obj.ready_dram()
            if not dram:
                started = promote and tiers.start_promotion(self, obj, now)
                if started:
                    promoting.append(i)
                    obj.lease_until = max(obj.lease_until, until)
                    objects.move_to_end(key)
                out.append(None)
                continue
            hits += 1
            if obj.lease_until < until:
                obj.lease_until = until
            objects.move_to_end(key)
            if len(dram) > 1:  # round-robin: spread readers over copies
                turn = obj.gets % len(dram)
                dram = dram[turn:] + dram[:turn]
            obj.gets += 1
            if count_reads:
                hot.count_read(self, obj, now)
            out.append([(r.node_id, r.offset or 0) for r in dram])
        self.counters["hits"] += hits
        self.counters["misses"] += len(out) - hits - len(promoting)
        return out, promoting

    # ------------------------------------------------------------------ puts
    def put_start(self, keys: list[str], size: int, replica_num: int,
                  now: float) -> list[PutSlot]:
        slots: list[PutSlot] = []
        dry: set[str] = set()  # nodes with nothing more to evict in this call
        for key in keys:
            if key in self.objects:
                slots.append(PutSlot("exists"))  # committed or in flight: skip it
                continue
            locations = self._place(size, max(1, replica_num), now, dry)
            if not locations:
                slots.append(PutSlot("nospace"))
                continue
            deadline = now + self.grant_s(self.config.put_timeout_s, size * len(keys))
            obj = StoreObject(key, size, [Replica(n, DRAM, S.WRITING, off, deadline)
                                          for n, off in locations])
            self.objects[key] = obj
            self.arm(key, deadline)
            slots.append(PutSlot("new", tuple(locations)))
        return slots

    def put_end(self, keys: list[str], ok: list[bool], now: float) -> list[bool]:
        """Commit (ok) or abandon (not ok) in-flight puts. Returns which were committed;
        a put already reclaimed as a zombie is not."""
        committed: list[bool] = []
        for key, success in zip(keys, ok):
            obj = self.objects.get(key)
            if obj is None or obj.complete:
                committed.append(False)
                continue
            if not success:
                self._forget(key)
                committed.append(False)
                continue
            obj.complete = True
            for rep in obj.replicas:
                rep.move(S.READY)
            self.objects.move_to_end(key)
            self.events.emit("stored", key)
            committed.append(True)
        return committed

    def remove(self, keys: list[str], now: float) -> int:
        """Remove complete, unleased objects whose replicas are all READY. Returns how many."""
        removed = 0
        for key in keys:
            obj = self.objects.get(key)
            if obj is None or not obj.complete or obj.leased(now):
                continue
            if any(r.state is not S.READY for r in obj.replicas):
                continue
            self._forget(key)
            removed += 1
        return removed

    # -------------------------------------------------- answers from nodes
    def offload_done(self, node_id: str, key: str, ok: bool, now: float) -> None:
        """The node wrote (ok) or failed to write its DRAM copy to its SSD. An answer that
        finds no OFFLOADING copy there (already reaped, or stray) changes nothing."""
        obj = self.objects.get(key)
        node = self.nodes.get(node_id)
        dram = obj.replica(node_id, DRAM) if obj is not None else None
        ssd = obj.replica(node_id, SSD) if obj is not None else None
        if obj is None or node is None or dram is None or dram.state is not S.OFFLOADING:
            return
        assert ssd is not None, "an OFFLOADING copy always has its SSD copy being written"
        dram.move(S.READY)
        node.offloading_bytes -= obj.size
        if ok:
            ssd.move(S.READY)
            self.counters["offloaded"] += 1
        else:
            self.drop_replica(obj, ssd)
        if ok and not obj.leased(now):
            self.drop_replica(obj, dram)  # a lease taken meanwhile keeps the DRAM copy

    def promote_done(self, node_id: str, key: str, ok: bool) -> None:
        """The node read its SSD copy into DRAM (ok) or gave up; only a PROMOTING copy
        there is affected."""
        obj = self.objects.get(key)
        rep = obj.replica(node_id, DRAM) if obj is not None else None
        if obj is None or rep is None or rep.state is not S.PROMOTING:
            return
        if ok:
            rep.move(S.READY)
            self.counters["promoted"] += 1
        else:
            self.drop_replica(obj, rep)

    def replicate_done(self, node_id: str, key: str, offset: int, ok: bool) -> bool:
        """The target node finished copying (ok) or gave up. Returns whether a replica was
        committed; an answer for a replica already reclaimed (or another one) changes
        nothing."""
        obj = self.objects.get(key)
        rep = obj.replica(node_id, DRAM) if obj is not None else None
        if (obj is None or rep is None or rep.state is not S.REPLICATING
                or rep.offset != offset):
            return False
        if not ok:
            self.counters["replications_failed"] += 1
            self.drop_replica(obj, rep)
            return False
        rep.move(S.READY)
        self.counters["replications"] += 1
        return True

    def drain_commands(self) -> list[NodeCommand]:
        commands, self.commands = self.commands, []
        return commands

    # ------------------------------------------------------------ internals
    def _place(self, size: int, replica_num: int, now: float,
               dry: set[str]) -> list[Location]:
        """Allocate on up to ``replica_num`` distinct nodes, most free space first."""
        order = sorted(self.nodes.values(), key=lambda n: n.pressure_bytes())
        locations: list[Location] = []
        for node in order:
            if len(locations) == replica_num:
                break
            offset = self.allocate(node, size, now, dry=dry)
            if offset is not None:
                locations.append((node.node_id, offset))
        return locations

    def allocate(self, node: NodeState, size: int, now: float,
                 spare: Optional[StoreObject] = None,
                 dry: Optional[set[str]] = None) -> Optional[int]:
        """DRAM on ``node``, evicting first if it would cross the watermark (``spare``: see
        ``tiers.evict``). ``dry``: the nodes whose eviction came up short earlier in this
        call, not scanned again (at the same ``now`` no copy became evictable: a put of
        1,024 keys into a store of 10,240 leased objects scanned them all per key, 4-9 s)."""
        need = node.allocator.round(size)
        if node.pressure_bytes() + need > self.config.high_watermark * node.capacity and (
                dry is None or node.node_id not in dry):
            if not tiers.evict(self, node, now, spare) and dry is not None:
                dry.add(node.node_id)
        return node.allocator.allocate(size)

    def drop_replica(self, obj: StoreObject, rep: Replica) -> None:
        """Drop one copy (give back its space); an object left with none is forgotten."""
        rep.move(S.DROPPED)
        self._release(obj, rep)
        obj.replicas.remove(rep)
        if not obj.replicas:
            self._forget(obj.key)

    def _release(self, obj: StoreObject, rep: Replica) -> None:
        """Give back what a dropped replica held on its node (if the node is still known)."""
        node = self.nodes.get(rep.node_id)
        if node is None:
            return
        if rep.tier == DRAM:
            node.allocator.free(rep.offset or 0)
        else:
            node.ssd_used -= obj.size
            self.commands.append(NodeCommand(node.node_id, "drop_ssd", obj.key, 0, obj.size))

    def _forget(self, key: str) -> None:
        obj = self.objects.pop(key, None)
        if obj is None:
            return
        for rep in obj.replicas:
            rep.move(S.DROPPED)
            self._release(obj, rep)
        obj.replicas = []
        if obj.complete:
            self.events.emit("removed", key)

    # ------------------------------------------------- queries for the service
    def promoting_nodes(self, key: str) -> list[str]:
        """Nodes reading ``key`` in from their SSD right now (a get waits for these)."""
        obj = self.objects.get(key)
        return [r.node_id for r in obj.replicas if r.state is S.PROMOTING] if obj else []

    def committed_keys(self) -> list[str]:
        """Every key whose ``stored`` event has been emitted and no ``removed`` since."""
        return [k for k, o in self.objects.items() if o.complete]

    def node_infos(self, node_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """What a client needs to reach each known node; unknown ids are left out."""
        return {n: self.nodes[n].info for n in node_ids if n in self.nodes}

    def stats(self) -> dict[str, Any]:
        """Per-node space, the object count and the policy's counters (a snapshot)."""
        nodes = {n.node_id: {"dram_used": n.allocator.used_bytes, "dram_capacity": n.capacity,
                             "ssd_used": n.ssd_used, "ssd_capacity": n.ssd_capacity}
                 for n in self.nodes.values()}
        return {"nodes": nodes, "objects": len(self.objects), "counters": dict(self.counters)}

    def check_integrity(self) -> None:
        """Every DRAM replica owns exactly one allocation; usage counters add up."""
        check_metadata(self)
