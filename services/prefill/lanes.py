"""One FIFO write thread per decode peer, so one hung peer stalls only its own streams.

A stream's writes must land in order (``KVStream`` waits for its last one), so each peer
gets its own single thread. Lanes are few (one per decode instance the worker writes to)
and bounded: beyond ``limit`` the least recently used lane is shut down (writes already
queued in it still run) and made again on its next use.
"""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor


class Lanes:
    def __init__(self, limit: int = 64) -> None:
        if limit < 1:
            raise ValueError("Lanes needs a limit of at least 1")
        self.limit = limit
        self._lanes: OrderedDict[str, ThreadPoolExecutor] = OrderedDict()

    def get(self, peer: str) -> ThreadPoolExecutor:
        """The write thread of ``peer`` (a decode instance id)."""
        lane = self._lanes.pop(peer, None)
        if lane is None:
            lane = ThreadPoolExecutor(1, thread_name_prefix=f"kv-{peer}")
            while len(self._lanes) >= self.limit:
                _, old = self._lanes.popitem(last=False)
                old.shutdown(wait=False)
        self._lanes[peer] = lane
        return lane

    def __len__(self) -> int:
        return len(self._lanes)

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=True)
        self._lanes.clear()
