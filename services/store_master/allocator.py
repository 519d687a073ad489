"""Offset allocator over one node segment: a sorted free list with coalescing.

Pure policy (no zmq, no torch). Ranges are ``[offset, offset + size)`` in bytes; every
allocation is rounded up to ``alignment``. Invariant (``check_integrity``): free and used
ranges are disjoint, each list is non-overlapping, no two free ranges touch (they would have
been coalesced), and ``free_bytes + used_bytes == capacity``.
"""
from __future__ import annotations

import bisect
from typing import Optional


class AllocatorError(RuntimeError):
    """A free of a range that is not allocated, or a broken invariant."""


class OffsetAllocator:
    def __init__(self, capacity: int, alignment: int = 64) -> None:
        if capacity <= 0 or alignment <= 0:
            raise ValueError("capacity and alignment must be positive")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self._free_off: list[int] = [0] if self.capacity else []  # sorted offsets
        self._free_len: list[int] = [self.capacity] if self.capacity else []
        self._used: dict[int, int] = {}  # offset -> rounded size
        self.used_bytes = 0

    # ------------------------------------------------------------------ verbs
    def round(self, size: int) -> int:
        return -(-size // self.alignment) * self.alignment

    def allocate(self, size: int) -> Optional[int]:
        """First fit; ``None`` when no free range is large enough."""
        if size <= 0:
            raise ValueError("size must be positive")
        need = self.round(size)
        for i, length in enumerate(self._free_len):
            if length >= need:
                offset = self._free_off[i]
                if length == need:
                    del self._free_off[i]
                    del self._free_len[i]
                else:
                    self._free_off[i] = offset + need
                    self._free_len[i] = length - need
                self._used[offset] = need
                self.used_bytes += need
                return offset
        return None

    def free(self, offset: int) -> int:
        """Release the allocation starting at ``offset``; returns its rounded size."""
        size = self._used.pop(offset, None)
        if size is None:
            raise AllocatorError(f"free of unallocated offset {offset}")
        self.used_bytes -= size
        i = bisect.bisect_left(self._free_off, offset)
        merge_prev = i > 0 and self._free_off[i - 1] + self._free_len[i - 1] == offset
        merge_next = i < len(self._free_off) and offset + size == self._free_off[i]
        if merge_prev and merge_next:
            self._free_len[i - 1] += size + self._free_len[i]
            del self._free_off[i]
            del self._free_len[i]
        elif merge_prev:
            self._free_len[i - 1] += size
        elif merge_next:
            self._free_off[i] = offset
            self._free_len[i] += size
        else:
            self._free_off.insert(i, offset)
            self._free_len.insert(i, size)
        return size

    # ------------------------------------------------------------------ views
    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return max(self._free_len, default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._free_off, self._free_len))

    def used_ranges(self) -> list[tuple[int, int]]:
        return sorted(self._used.items())

    def check_integrity(self) -> None:
        ranges = [(o, n, "free") for o, n in self.free_ranges()]
        ranges += [(o, n, "used") for o, n in self.used_ranges()]
        ranges.sort()
        cursor = 0
        prev_kind = ""
        for offset, size, kind in ranges:
            if size <= 0 or offset % self.alignment or size % self.alignment:
                raise AllocatorError(f"bad {kind} range ({offset}, {size})")
            if offset != cursor:
                raise AllocatorError(f"gap or overlap at {offset} (expected {cursor})")
            if kind == "free" and prev_kind == "free":
                raise AllocatorError(f"uncoalesced free ranges at {offset}")
            cursor = offset + size
            prev_kind = kind
        if cursor != self.capacity:
            raise AllocatorError(f"ranges cover {cursor} of {self.capacity} bytes")
        if sum(self._used.values()) != self.used_bytes:
            raise AllocatorError("used_bytes does not match the used ranges")
