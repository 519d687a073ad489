"""Block events: what a block pool tells the conductor about its cache contents."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union


@dataclass(frozen=True)
class BlockStored:
    """A full block with `key` became reusable in this pool (stored at `block_id`)."""
    seq: int
    key: bytes
    block_id: int


@dataclass(frozen=True)
class BlockRemoved:
    """The block with `key` is no longer in this pool (evicted and reused)."""
    seq: int
    key: bytes
    block_id: int


BlockEvent = Union[BlockStored, BlockRemoved]


@dataclass(frozen=True)
class KVEvents:
    """A pool's block events since its last heartbeat, on the wire (``WorkerHeartbeat.
    events``), in sequence order: event i is number ``first_seq + i`` (a pool numbers its
    events one by one), ``kinds[i]`` is ``s`` (stored) or ``r`` (removed), ``keys[i]`` its
    key in hex. Columns, not an object per event: a beat after a 16k prompt carries ~1,000,
    which as objects took the conductor 2.3 ms to decode. A block stored and evicted between
    two beats ends up absent, as it is."""

    first_seq: int = 1
    kinds: str = ""
    keys: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.first_seq < 1:
            raise ValueError(f"first_seq must be positive, not {self.first_seq}")
        if len(self.kinds) != len(self.keys):
            raise ValueError(f"{len(self.kinds)} kinds for {len(self.keys)} keys")
        if self.kinds.strip("sr"):
            raise ValueError(f"kinds are 's' (stored) or 'r' (removed), not {self.kinds!r}")

    @classmethod
    def of(cls, events: Sequence[BlockEvent]) -> "KVEvents":
        """A drained run of a pool's events (numbered one by one)."""
        if not events:
            return cls()
        if events[-1].seq - events[0].seq != len(events) - 1:
            raise ValueError(f"events {events[0].seq}-{events[-1].seq} are not a run of "
                             f"{len(events)}")
        return cls(events[0].seq,
                   "".join("s" if isinstance(e, BlockStored) else "r" for e in events),
                   [e.key.hex() for e in events])

    def __len__(self) -> int:
        return len(self.keys)
