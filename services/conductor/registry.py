"""The conductor's view of live workers: registration, heartbeats, liveness, KV events."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from common.protocol import InstanceStatus, RegisterWorker, WorkerHeartbeat, WorkerLoad


# Which registered roles serve a role the scheduler asks for.
SERVES = {"prefill": ("prefill", "colocated"), "decode": ("decode", "colocated")}
ROLES = ("prefill", "decode", "colocated")


@dataclass
class WorkerState:
    info: RegisterWorker
    last_seen: float
    beat: Optional[WorkerHeartbeat] = None
    cached_keys: set[str] = field(default_factory=set)  # prefill: blocks in its local cache
    assigned: set[str] = field(default_factory=set)  # request ids placed here and not done
    pending_tokens: int = 0  # prefill: tokens assigned since the last heartbeat counted them

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def free_blocks(self) -> int:
        return self.beat.free_blocks if self.beat else self.info.num_blocks

    @property
    def load(self) -> WorkerLoad:
        """The load of the last heartbeat; none before the first."""
        return self.beat.load if self.beat else WorkerLoad()


class Registry:
    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.timeout = heartbeat_timeout_s
        self.workers: dict[str, WorkerState] = {}

    def register(self, msg: RegisterWorker, now: Optional[float] = None) -> WorkerState:
        """Add a worker, or refresh one that registers again (state is kept)."""
        state = self.workers.get(msg.instance_id)
        if state is None or state.info.transfer_session != msg.transfer_session:
            state = WorkerState(info=msg, last_seen=now or time.monotonic())
            self.workers[msg.instance_id] = state
        state.last_seen = now or time.monotonic()
        return state

    def heartbeat(self, msg: WorkerHeartbeat, now: Optional[float] = None) -> bool:
        """Apply a heartbeat; False if the worker is unknown (it must register again)."""
        state = self.workers.get(msg.instance_id)
        if state is None:
            return False
        state.last_seen = now or time.monotonic()
        state.beat = msg
        state.cached_keys.difference_update(msg.removed_keys)
        state.cached_keys.update(msg.stored_keys)
        return True

    def expire(self, now: Optional[float] = None) -> list[WorkerState]:
        """Remove and return workers silent for longer than the heartbeat timeout."""
        now = now or time.monotonic()
        dead = [w for w in self.workers.values() if now - w.last_seen > self.timeout]
        for w in dead:
            del self.workers[w.instance_id]
        return dead

    def by_role(self, role: str) -> list[WorkerState]:
        """Workers that serve ``role``; a colocated worker serves both prefill and decode."""
        roles = SERVES.get(role, (role,))
        return [w for w in self.workers.values() if w.info.role in roles]

    def get(self, instance_id: str) -> Optional[WorkerState]:
        return self.workers.get(instance_id)

    def status(self) -> list[InstanceStatus]:
        out = []
        for w in sorted(self.workers.values(), key=lambda w: w.instance_id):
            b = w.beat
            out.append(InstanceStatus(
                instance_id=w.instance_id, role=w.info.role, total_blocks=w.info.num_blocks,
                free_blocks=b.free_blocks if b else w.info.num_blocks,
                used_blocks=b.used_blocks if b else 0, queued=w.load.queued,
                running=w.load.running, assigned=len(w.assigned)))
        return out
