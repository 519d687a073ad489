"""One worker's cached block keys, as the conductor learns them from its KV events.

A heartbeat carries the events since the last beat in the pool's sequence order, and the
pool's latest sequence number. ``WorkerKV`` applies them in order, so a block stored and
evicted within one beat ends up absent. Two states:

    IN_SYNC ──a sequence number skipped, or event_seq ahead (a lost heartbeat)──→ RESYNCING
    RESYNCING ──KVSnapshot (every cached key as of event_seq)──→ IN_SYNC

While RESYNCING, events are dropped (the snapshot, taken after them, covers them) and the
keys known before the gap stay (mostly right) until the snapshot replaces them. The
conductor asks for the snapshot (``KVResync``) from its periodic sweep, again every
``retry_s`` until one arrives. A worker restart is a new incarnation (``epoch``): the
registry gives it a fresh ``WorkerKV``, so the old process's keys are dropped with it.
Pure: no sockets, time passed in.
"""
from __future__ import annotations

from typing import Iterable, Optional

from common.kv.events import KVEvents


class WorkerKV:
    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.last_seq = 0  # the latest event applied (or covered by a snapshot)
        self.resyncing = False
        self.asked_at: Optional[float] = None  # when a snapshot was last asked for
        self.gaps = 0
        self.resyncs = 0

    def apply(self, events: KVEvents, event_seq: int) -> None:
        """Apply one heartbeat's events in order; a gap starts a resync."""
        if self.resyncing:
            return
        skip = self.last_seq + 1 - events.first_seq  # covered already by a snapshot
        if len(events) > max(skip, 0):
            if skip < 0:  # events between the last beat's and these were lost
                return self._gap()
            keys = self.keys
            for kind, key in zip(events.kinds[skip:], events.keys[skip:]):
                if kind == "s":
                    keys.add(key)
                else:
                    keys.discard(key)
            self.last_seq = events.first_seq + len(events) - 1
        if event_seq > self.last_seq:  # the tail of the events was lost
            self._gap()

    def _gap(self) -> None:
        self.gaps += 1
        self.resyncing = True
        self.asked_at = None

    def snapshot_due(self, now: float, retry_s: float) -> bool:
        """True (and noted) when a KVResync should be sent now."""
        if not self.resyncing or (self.asked_at is not None and now - self.asked_at < retry_s):
            return False
        self.asked_at = now
        return True

    def on_snapshot(self, event_seq: int, keys: Iterable[str]) -> bool:
        """Hold exactly ``keys`` as of ``event_seq``; an older snapshot than what was
        applied (a duplicate answer) changes nothing. True if applied."""
        if event_seq < self.last_seq:
            return False
        self.keys.clear()
        self.keys.update(keys)
        self.last_seq = event_seq
        self.resyncing = False
        self.asked_at = None
        self.resyncs += 1
        return True
