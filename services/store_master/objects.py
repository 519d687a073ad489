"""Records the master keeps: objects, nodes, KV events, node commands (replicas: replica.py).

Pure data (no zmq, no torch). ``StoreMetadata`` (metadata.py) is the only writer.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from services.store_master.allocator import OffsetAllocator
from services.store_master.replica import DRAM, READABLE, Replica, ReplicaState


@dataclass
class StoreObject:
    key: str
    size: int
    replicas: list[Replica] = field(default_factory=list)
    complete: bool = False  # put_end committed it; readers see only complete objects
    lease_until: float = 0.0
    reads: Optional[deque[float]] = None  # recent read times (hot-block detection)
    gets: int = 0  # reads served: rotates the replica order handed to readers

    def leased(self, now: float) -> bool:
        """Leased by a reader, or pinned as the source of a replication in flight."""
        return self.lease_until > now or self.replicating() is not None

    def replicating(self) -> Optional[Replica]:
        for rep in self.replicas:
            if rep.state is ReplicaState.REPLICATING:
                return rep
        return None

    def zombie(self, now: float) -> bool:
        """An uncommitted put whose time ran out (its WRITING replicas own the deadline)."""
        return not self.complete and any(r.expired(now) for r in self.replicas)

    def replica(self, node_id: str, tier: str) -> Optional[Replica]:
        for rep in self.replicas:
            if rep.node_id == node_id and rep.tier == tier:
                return rep
        return None

    def ready_dram(self) -> list[Replica]:
        return [r for r in self.replicas if r.tier == DRAM and r.state in READABLE]

    def readable(self) -> bool:
        return self.complete and any(r.state.readable for r in self.replicas)

    def note_read(self, now: float, window_s: float, keep: int) -> int:
        """Record a read at ``now``; return how many reads fall within the window."""
        if self.reads is None:
            self.reads = deque(maxlen=keep)
        reads = self.reads
        reads.append(now)
        while reads and now - reads[0] > window_s:
            reads.popleft()
        return len(reads)


@dataclass
class NodeState:
    node_id: str
    allocator: OffsetAllocator
    ssd_capacity: int
    info: dict[str, Any]  # what clients need: session_id, base, shm_path, hostname, epoch
    last_seen: float
    ssd_used: int = 0
    offloading_bytes: int = 0  # DRAM bytes whose offload is under way (freed on completion)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def pressure_bytes(self) -> int:
        """Used DRAM bytes not already on their way out."""
        return self.allocator.used_bytes - self.offloading_bytes


@dataclass(frozen=True)
class NodeCommand:
    """Work the master asks a node to do; the service turns these into wire messages."""

    node_id: str
    kind: str  # "offload" (segment → SSD), "promote" (SSD → segment), "drop_ssd",
    #            "replicate" (another node's segment → this node's segment)
    key: str
    offset: int  # DRAM offset (unused for drop_ssd)
    size: int
    source_node: str = ""  # replicate: copy from this node's segment ...
    source_offset: int = 0  # ... at this offset


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: str  # "stored" | "removed"
    key: str


class EventLog:
    """KV events with sequence numbers; the last ``keep`` are kept for polling."""

    def __init__(self, keep: int = 100_000) -> None:
        self.seq = 0
        self._events: deque[KVEvent] = deque(maxlen=keep)
        self.fresh: list[KVEvent] = []  # appended since the service last drained them

    def emit(self, kind: str, key: str) -> None:
        self.seq += 1
        event = KVEvent(self.seq, kind, key)
        self._events.append(event)
        self.fresh.append(event)

    def since(self, after_seq: int, limit: int = 10_000) -> list[KVEvent]:
        """Events with ``seq > after_seq`` (the oldest may have been dropped: check seq)."""
        out: list[KVEvent] = []
        for event in reversed(self._events):
            if event.seq <= after_seq:
                break
            out.append(event)
        out.reverse()
        return out[:limit]

    def drain(self) -> list[KVEvent]:
        fresh, self.fresh = self.fresh, []
        return fresh
