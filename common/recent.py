"""A bounded memory of the keys seen last: the newest ``size`` are remembered, the oldest
forgotten first. Workers use it for what a late or replayed message must still find
(fences already served, requests already aborted) without growing forever."""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)


class Recent(Generic[K]):
    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be positive, got {size}")
        self.size = size
        self._keys: OrderedDict[K, None] = OrderedDict()

    def add(self, key: K) -> None:
        """Remember ``key`` (a key already remembered keeps its place)."""
        self._keys[key] = None
        while len(self._keys) > self.size:
            self._keys.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
