"""A prefill process's threads (``PrefillThreads``), and one FIFO write thread per decode
peer among them (``Lanes``), so one hung peer stalls only its own streams.

A stream's writes must land in order (``KVStream`` waits for its last one), so each peer
gets its own single thread. Lanes are few (one per decode instance the worker writes to)
and bounded: beyond ``limit`` the least recently used lane is shut down (writes already
queued in it still run) and made again on its next use.
"""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field


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


def _one(name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix=name)


@dataclass
class PrefillThreads:
    """The threads of a prefill worker and of a later stage of its group, made here for
    both: ``compute`` runs the steps (one at a time), ``load`` and ``store`` are the
    ordered lanes of store reads and writes, ``peers`` the write lanes of the decode
    workers it streams KV to."""

    compute: ThreadPoolExecutor = field(default_factory=lambda: _one("prefill"))
    load: ThreadPoolExecutor = field(default_factory=lambda: _one("kv-load"))
    store: ThreadPoolExecutor = field(default_factory=lambda: _one("kv-store"))
    peers: Lanes = field(default_factory=Lanes)

    def close(self) -> None:
        """Once nothing is computing: queued store work is dropped (its requests are gone
        with the process), and each peer's queued writes finish."""
        for lane in (self.compute, self.load, self.store):
            lane.shutdown(wait=False)
        self.peers.close()
