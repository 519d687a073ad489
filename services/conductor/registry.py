"""The conductor's view of live workers: registration, heartbeats, liveness, KV events."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from common.protocol import KVSnapshot, RegisterWorker, WorkerHeartbeat, WorkerLoad
from common.status_protocol import InstanceStatus
from services.conductor.tracker import Tracked
from services.conductor.worker_kv import WorkerKV


# Every change of a worker's ``assigned`` gets the next of these, across workers and their
# incarnations: a queue priced at a stamp (services/conductor/placement.py) is current while
# its worker's stamp is the same.
_STAMPS = itertools.count(1)

# Which registered roles serve a role the scheduler asks for.
SERVES = {"prefill": ("prefill", "colocated"), "decode": ("decode", "colocated")}
ROLES = ("prefill", "decode", "colocated")


@dataclass
class WorkerState:
    info: RegisterWorker
    last_seen: float
    beat: Optional[WorkerHeartbeat] = None
    kv: WorkerKV = field(default_factory=WorkerKV)  # blocks in its local cache
    assigned: dict[str, Tracked] = field(default_factory=dict)  # placed here, not done
    sequences: int = 0  # what ``assigned`` decodes as: n for a request of n choices
    stamp: int = 0  # of ``assigned``'s last change, unique in the process (see ``_STAMPS``)
    pending_tokens: int = 0  # prefill: tokens assigned since the last heartbeat counted them

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def cached_keys(self) -> set[str]:
        return self.kv.keys

    @property
    def free_blocks(self) -> int:
        return self.beat.free_blocks if self.beat else self.info.num_blocks

    @property
    def load(self) -> WorkerLoad:
        """The load of the last heartbeat; none before the first."""
        return self.beat.load if self.beat else WorkerLoad()


class Registry:
    def __init__(self, heartbeat_timeout_s: float, resync_retry_s: float = 1.0) -> None:
        self.timeout = heartbeat_timeout_s
        self.resync_retry_s = resync_retry_s  # a KVResync unanswered this long is sent again
        self.workers: dict[str, WorkerState] = {}

    def register(self, msg: RegisterWorker, now: Optional[float] = None) -> WorkerState:
        """Add a worker, or refresh one that registers again (state is kept)."""
        state = self.workers.get(msg.instance_id)
        if state is None or state.info.transfer_session != msg.transfer_session \
                or state.info.epoch != msg.epoch:  # a new incarnation: nothing carries over
            state = WorkerState(info=msg, last_seen=now or time.monotonic())
            self.workers[msg.instance_id] = state
        state.last_seen = now or time.monotonic()
        return state

    def heartbeat(self, msg: WorkerHeartbeat, now: Optional[float] = None) -> bool:
        """Apply a heartbeat; False if the worker is unknown (it must register again)."""
        state = self.workers.get(msg.instance_id)
        if state is None or state.info.epoch != msg.epoch:  # unknown, or another incarnation
            return False
        state.last_seen = now or time.monotonic()
        state.beat = msg
        state.kv.apply(msg.events, msg.event_seq)
        return True

    def kv_snapshot(self, msg: KVSnapshot) -> bool:
        """Apply a worker's KVSnapshot; False if not for its live incarnation or stale."""
        state = self.workers.get(msg.instance_id)
        if state is None or state.info.epoch != msg.epoch:
            return False
        return state.kv.on_snapshot(msg.event_seq, msg.keys)

    def kv_resyncs_due(self, now: Optional[float] = None) -> list[WorkerState]:
        """Workers whose KV events had a gap and that should be sent KVResync now."""
        now = time.monotonic() if now is None else now
        return [w for w in self.workers.values() if w.kv.snapshot_due(now, self.resync_retry_s)]

    def expire(self, now: Optional[float] = None) -> list[WorkerState]:
        """Remove and return workers silent for longer than the heartbeat timeout."""
        now = now or time.monotonic()
        dead = [w for w in self.workers.values() if now - w.last_seen > self.timeout]
        for w in dead:
            del self.workers[w.instance_id]
        return dead

    def by_role(self, role: str) -> list[WorkerState]:
        """Workers that serve ``role`` and take new work (a draining one does not); a
        colocated worker serves both prefill and decode."""
        roles = SERVES.get(role, (role,))
        return [w for w in self.workers.values()
                if w.info.role in roles and not (w.beat and w.beat.draining)]

    def get(self, instance_id: str) -> Optional[WorkerState]:
        return self.workers.get(instance_id)

    # ------------------------------------------------------------ requests placed here
    def assign(self, t: Tracked) -> None:
        """``t`` is placed on its workers: each counts it, its prefill its tokens."""
        for wid in {t.prefill_id, t.decode_id}:
            w = self.workers[wid]
            w.assigned[t.req.request_id] = t
            w.sequences += t.req.sampling.n
            w.stamp = next(_STAMPS)
        self.workers[t.prefill_id].pending_tokens += t.prefill_tokens

    def hold_off(self, instance_id: str) -> None:
        """Place nothing more on ``instance_id`` until its next heartbeat says otherwise,
        as if it had said it drains (a group head refused a task: a stage of its group is
        down, and the head exits or beats again once the stage is back)."""
        w = self.workers.get(instance_id)
        if w is not None and w.beat is not None:
            w.beat = replace(w.beat, draining=True)

    def release_prefill(self, t: Tracked) -> None:
        """``t``'s prefill worker is done with it (again: nothing changes)."""
        prefill = self.workers.get(t.prefill_id)
        if prefill is not None and _unassign(prefill, t):
            prefill.pending_tokens = max(0, prefill.pending_tokens - t.prefill_tokens)

    def release(self, t: Tracked) -> None:
        """Both of ``t``'s workers are done with it."""
        self.release_prefill(t)
        decode = self.workers.get(t.decode_id)
        if decode is not None:
            _unassign(decode, t)

    def status(self, now: Optional[float] = None) -> list[InstanceStatus]:
        now = time.monotonic() if now is None else now
        out = []
        for w in sorted(self.workers.values(), key=lambda w: w.instance_id):
            b, load = w.beat, w.load
            out.append(InstanceStatus(
                instance_id=w.instance_id, role=w.info.role, total_blocks=w.info.num_blocks,
                free_blocks=b.free_blocks if b else w.info.num_blocks,
                used_blocks=b.used_blocks if b else 0, queued=load.queued,
                running=load.running, assigned=len(w.assigned),
                queued_tokens=load.queued_tokens, context_tokens=load.context_tokens,
                cached_blocks=len(w.kv.keys), draining=bool(b and b.draining),
                heartbeat_age_s=round(max(0.0, now - w.last_seen), 3)))
        return out


def _unassign(w: WorkerState, t: Tracked) -> bool:
    """Take ``t`` off ``w`` if it is there (not another attempt's record); True if it was."""
    if w.assigned.get(t.req.request_id) is not t:
        return False
    del w.assigned[t.req.request_id]
    w.sequences -= t.req.sampling.n
    w.stamp = next(_STAMPS)
    return True
