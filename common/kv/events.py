"""Block events: what a block pool tells the conductor about its cache contents."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


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


KINDS = ("stored", "removed")


@dataclass(frozen=True)
class BlockEventMsg:
    """A block event on the wire (``WorkerHeartbeat.events``): the pool's sequence number,
    ``stored`` or ``removed``, the key in hex. A heartbeat carries them in sequence order,
    so a block stored and evicted between two beats ends up absent, as it is."""
    seq: int
    kind: str
    key: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {self.kind!r}")
        if self.seq < 1:
            raise ValueError(f"seq must be positive, not {self.seq}")

    @classmethod
    def of(cls, event: BlockEvent) -> "BlockEventMsg":
        kind = "stored" if isinstance(event, BlockStored) else "removed"
        return cls(event.seq, kind, event.key.hex())
