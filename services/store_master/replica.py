"""A replica's life as an explicit state machine: one enum, one transition table, one verb.

A replica is one copy of an object on one node's tier: its DRAM segment or its SSD
directory. Every change of state goes through ``Replica.move``; a move the table does not
allow raises ``IllegalTransition``: that is a bug in the policy, never bad input (a late or
stray answer from a node is recognised by the state it finds and ignored before it gets
here). A state that waits on a node owns its deadline; no other state has one.

DRAM::

    put_start ─→ WRITING ──put_end──→ READY ──evict, with SSD room──→ OFFLOADING
    a get of an SSD-only object ─→ PROMOTING ──done──→ READY ←──answer / deadline── OFFLOADING
    a hot object ─→ REPLICATING ──done──→ READY
    WRITING, READY, PROMOTING, REPLICATING ──failed / deadline / evicted / removed──→ DROPPED

SSD (written only by an offload; read by a promotion without changing state)::

    offload ─→ WRITING ──done──→ READY ──room needed──→ DROPPED;  WRITING ──failed──→ DROPPED

An OFFLOADING copy is never dropped directly: the offload's answer (or its deadline) first
takes it back to READY. A replica whose node is forgotten vanishes with the node.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

DRAM = "dram"
SSD = "ssd"


class ReplicaState(enum.Enum):
    WRITING = "writing"  # bytes on their way in: a put (DRAM) or an offload (SSD)
    READY = "ready"
    OFFLOADING = "offloading"  # DRAM copy being written to this node's SSD: still readable
    PROMOTING = "promoting"  # DRAM copy being read in from this node's SSD
    REPLICATING = "replicating"  # DRAM copy being fetched from another node (``source``)
    DROPPED = "dropped"  # gone, its space given back; terminal

    @property
    def readable(self) -> bool:
        """Readers may be sent to (DRAM) or promote from (SSD) a replica in this state."""
        return self in READABLE


S = ReplicaState
READABLE = frozenset({S.READY, S.OFFLOADING})

# The states a new replica may be born in, per tier.
BIRTHS: dict[str, frozenset[ReplicaState]] = {
    DRAM: frozenset({S.WRITING, S.PROMOTING, S.REPLICATING}),
    SSD: frozenset({S.WRITING}),
}

# (tier, from) → the states it may move to. DROPPED has no entry: nothing leaves it.
MOVES: dict[tuple[str, ReplicaState], frozenset[ReplicaState]] = {
    (DRAM, S.WRITING): frozenset({S.READY, S.DROPPED}),
    (DRAM, S.READY): frozenset({S.OFFLOADING, S.DROPPED}),
    (DRAM, S.OFFLOADING): frozenset({S.READY}),
    (DRAM, S.PROMOTING): frozenset({S.READY, S.DROPPED}),
    (DRAM, S.REPLICATING): frozenset({S.READY, S.DROPPED}),
    (SSD, S.WRITING): frozenset({S.READY, S.DROPPED}),
    (SSD, S.READY): frozenset({S.DROPPED}),
}

# States that wait on a node, and so carry a deadline (an SSD copy being written ends with
# the offload of its DRAM copy, which carries the deadline for both).
TIMED: frozenset[tuple[str, ReplicaState]] = frozenset({
    (DRAM, S.WRITING), (DRAM, S.OFFLOADING), (DRAM, S.PROMOTING), (DRAM, S.REPLICATING)})


class IllegalTransition(ValueError):
    """A state change the table does not allow, or a deadline/source that does not fit."""


@dataclass
class Replica:
    """One copy of an object. A DRAM replica has an ``offset`` in its node's segment."""

    node_id: str
    tier: str
    state: ReplicaState
    offset: Optional[int] = None  # DRAM only: where in the node's segment
    deadline: Optional[float] = None  # TIMED states only: given up after this
    source: Optional[str] = None  # REPLICATING only: the node its bytes come from

    def __post_init__(self) -> None:
        if self.state not in BIRTHS.get(self.tier, frozenset()):
            raise IllegalTransition(f"a {self.tier} replica cannot start {self.state.name}")
        if (self.offset is None) != (self.tier == SSD):
            raise IllegalTransition(f"a {self.tier} replica with offset {self.offset}")
        self._check(self.state, self.deadline, self.source)

    def move(self, to: ReplicaState, deadline: Optional[float] = None) -> None:
        """The one way a replica changes state; ``deadline`` exactly when ``to`` is timed."""
        if to not in MOVES.get((self.tier, self.state), frozenset()):
            raise IllegalTransition(f"{self.tier} replica on {self.node_id}: "
                                    f"{self.state.name} → {to.name}")
        self._check(to, deadline, None)
        self.state, self.deadline, self.source = to, deadline, None

    def expired(self, now: float) -> bool:
        return self.deadline is not None and self.deadline <= now

    def _check(self, state: ReplicaState, deadline: Optional[float],
               source: Optional[str]) -> None:
        if ((self.tier, state) in TIMED) != (deadline is not None):
            raise IllegalTransition(f"{self.tier} {state.name} with deadline {deadline}")
        if (state is S.REPLICATING) != (source is not None):
            raise IllegalTransition(f"{self.tier} {state.name} with source {source!r}")
