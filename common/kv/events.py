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
