"""Block pool: ref counts, an eviction-ordered free list and a key -> block prefix cache.

Pure python (no torch). Mechanism only: it knows nothing of requests.

Invariants (check_integrity):
  * every block is exactly one of: free-uncached, free-cached (evictable), used (ref > 0);
  * num_free_uncached + num_evictable + num_used == num_blocks;
  * the key map and each block's key agree; free-uncached blocks carry no key.
Eviction order: never-cached free blocks are handed out first, then cached-but-free blocks,
least recently freed first. A sequence's blocks are freed tail first, so a shared prefix's
head outlives its tail.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Sequence

from common.kv.events import BlockEvent, BlockRemoved, BlockStored


class OutOfBlocksError(RuntimeError):
    """allocate() was asked for more blocks than are free."""


class BlockPool:
    def __init__(self, num_blocks: int, on_event: Optional[Callable[[BlockEvent], None]] = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._key: list[Optional[bytes]] = [None] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self._free_plain: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._events: list[BlockEvent] = []
        self._seq = 0
        self.on_event = on_event

    # ---- counts -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out (free-uncached plus evictable)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_evictable(self) -> int:
        return len(self._free_cached)

    @property
    def num_free_uncached(self) -> int:
        return len(self._free_plain)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a reusable key (used or evictable)."""
        return len(self._by_key)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_key(self, block_id: int) -> Optional[bytes]:
        return self._key[block_id]

    def free_order(self) -> list[int]:
        """Block ids in the order allocate() would hand them out."""
        return list(self._free_plain) + list(self._free_cached)

    # ---- verbs --------------------------------------------------------------------
    def peek_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys cached here, without taking references."""
        return len(self.cached_prefix(keys))

    def cached_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of `keys`, without taking references."""
        blocks: list[int] = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def match_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of `keys`; takes one reference on each."""
        blocks: list[int] = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            self._take(block)
            blocks.append(block)
        return blocks

    def try_allocate(self, n: int) -> Optional[list[int]]:
        """n fresh blocks (ref 1, no key), or None when fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            return None
        plain = self._free_plain
        take = min(n, len(plain))  # never-cached blocks first: no key to drop
        out = [plain.popitem(last=False)[0] for _ in range(take)]
        for _ in range(n - take):
            block, _ = self._free_cached.popitem(last=False)
            self._drop_key(block)
            out.append(block)
        ref = self._ref
        for block in out:
            ref[block] = 1
        return out

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks; raises OutOfBlocksError when fewer than n are free."""
        blocks = self.try_allocate(n)
        if blocks is None:
            raise OutOfBlocksError(
                f"cannot allocate {n} KV blocks: only {self.num_free} of {self.num_blocks} free")
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each block in use: another sequence reads them too
        (the prompt blocks of a request's n choices); each holder frees its own."""
        for block in blocks:
            if self._ref[block] <= 0:
                raise ValueError(f"block {block} is not in use and cannot be shared")
        for block in blocks:
            self._ref[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; freed in reverse order (tail evicted first)."""
        for block in blocks:
            if self._ref[block] <= 0:
                raise ValueError(f"block {block} freed more times than referenced")
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                target = self._free_cached if self._key[block] is not None else self._free_plain
                target[block] = None

    def cache_full_blocks(self, block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """Publish full blocks under their chained keys so later prompts can reuse them.

        A key already cached at another block keeps its first block; this one stays private.
        """
        if len(block_ids) < len(keys):
            raise ValueError(f"{len(keys)} keys for only {len(block_ids)} blocks")
        for block, key in zip(block_ids, keys):
            if self._ref[block] <= 0:
                raise ValueError(f"block {block} is not in use and cannot be cached")
            if self._key[block] is not None:
                if self._key[block] != key:
                    raise ValueError(f"block {block} already cached under another key")
                continue
            if key in self._by_key:
                continue
            self._key[block] = key
            self._by_key[key] = block
            self._emit(BlockStored(self._next_seq(), key, block))

    # ---- events -------------------------------------------------------------------
    def drain_events(self) -> list[BlockEvent]:
        """KV events since the last drain, in sequence order."""
        events, self._events = self._events, []
        return events

    @property
    def last_seq(self) -> int:
        """The sequence number of the latest event (0: none yet)."""
        return self._seq

    def cached_keys(self) -> list[bytes]:
        """Every key cached now: the pool's contents as of event ``last_seq``."""
        return list(self._by_key)

    # ---- integrity ----------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the pool is broken."""
        plain, cached = set(self._free_plain), set(self._free_cached)
        assert not plain & cached, "block in both free lists"
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        assert not used & (plain | cached), "referenced block on a free list"
        assert len(plain) + len(cached) + len(used) == self.num_blocks, "blocks lost or doubled"
        assert all(r >= 0 for r in self._ref), "negative ref count"
        assert all(self._key[b] is None for b in plain), "free-uncached block with a key"
        assert all(self._key[b] is not None for b in cached), "evictable block without a key"
        for key, block in self._by_key.items():
            assert self._key[block] == key, f"key map disagrees at block {block}"
        assert sum(k is not None for k in self._key) == len(self._by_key), "stray block keys"

    def check_idle(self) -> None:
        """``check_integrity``, and no block referenced: what holds while the pool's worker
        has nothing queued, running or in flight (a referenced block then is a leak)."""
        self.check_integrity()
        assert self.num_used == 0, (f"{self.num_used} of {self.num_blocks} blocks still "
                                    "referenced with nothing queued or running")

    # ---- internals ----------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free_cached[block]
        self._ref[block] += 1

    def _drop_key(self, block: int) -> None:
        key = self._key[block]
        if key is None:
            return
        self._key[block] = None
        del self._by_key[key]
        self._emit(BlockRemoved(self._next_seq(), key, block))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _emit(self, event: BlockEvent) -> None:
        self._events.append(event)
        if self.on_event is not None:
            self.on_event(event)
