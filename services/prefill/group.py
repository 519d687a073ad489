"""A prefill group's plumbing: the hidden-state handoff to the next stage, and the head's
view of its followers (chunked pipeline parallelism, services/prefill/stage_protocol.py).

``NextStage``: where a stage ships each step's hidden states: the next stage's slots
(learned from its ``StageHello``), which of them are free (a slot is taken per step and
freed by the ``StageAck`` of that step), one sender thread so steps land in order.

``Followers``: the head's book of stages 1..S-1: their incarnations, whether they follow
this head (the group is ``ready``), the reports each request waits for, and the liveness
rule. A group lives and dies as one: a follower that restarts or falls silent takes the
head down with it (``StageLost``), so every request on the group fails over through the
conductor like any lost prefill worker, and no write of a stage that went away can land
after its blocks were given back.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from common.grammar import GrammarError
from common.host import host_id
from services.prefill.hidden import HiddenRoute, HiddenSender
from common.mailbox import Mailbox
from common.protocol import Fence
from common.sampling_params import SampledToken
from services.prefill.stage_protocol import (
    PartOpen, StageAbort, StageAck, StageBeat, StageHello, StagePart, StageReport, StageStep,
)
from common.transfer import TransferAgent, TransferError
from common.worker_metrics import current as metrics

if TYPE_CHECKING:
    from common.protocol import PrefillTask
    from common.store.ranges import RangeMover
    from common.worker import WorkerRuntime
    from services.prefill.streaming import KVPaths
    from services.prefill.layer_io import PartIO
    from services.prefill.prefix import PrefixPlan

log = logging.getLogger("prefill.group")


class StageLost(RuntimeError):
    """A stage of this group restarted or fell silent: the group restarts as one."""


class NextStage:
    """The hidden-state handoff from this stage to the next one."""

    def __init__(self, mail: Mailbox, transfer: TransferAgent, mode: str, inbox: str) -> None:
        self.mail = mail
        self.transfer = transfer
        self.mode = mode
        self.inbox = inbox
        self.sender: Optional[HiddenSender] = None
        self.route: Optional[HiddenRoute] = None
        self.free: set[int] = set()
        self.slot_freed = asyncio.Event()
        self.lane = ThreadPoolExecutor(1, thread_name_prefix="hidden")
        self.sent: dict[str, int] = {}  # hidden-state bytes shipped, by path (heartbeats)

    def on_hello(self, msg: StageHello) -> None:
        """The next stage's route; a new one (it restarted) resets the slots."""
        if msg.route == self.route:
            return
        if self.sender is not None:
            self.sender.close()
        self.route = msg.route
        self.sender = HiddenSender(self.transfer, msg.route, self.mode, host_id())
        self.free = set(range(msg.route.slots))
        self.slot_freed.set()
        log.info("hidden states to %s via %s (%d slots of %d MiB)", self.inbox,
                 self.sender.path, msg.route.slots, msg.route.slot_bytes >> 20)

    def on_ack(self, msg: StageAck) -> None:
        if self.route is not None and 0 <= msg.slot < self.route.slots:
            self.free.add(msg.slot)
            self.slot_freed.set()

    async def ship(self, head_epoch: int, step: int, hidden: torch.Tensor,
                   parts: list[StagePart], timeout_s: float) -> float:
        """Hidden states into a free slot of the next stage, then the step's message.
        Returns the seconds spent waiting for a slot (the next stage is behind)."""
        started = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while not self.free:
            self.slot_freed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(f"no free hidden-state slot at {self.inbox} in "
                                    f"{timeout_s:.0f}s")
            try:
                await asyncio.wait_for(self.slot_freed.wait(), left)
            except asyncio.TimeoutError:
                pass
        waited = time.perf_counter() - started
        assert self.sender is not None
        slot = self.free.pop()
        try:
            n = await asyncio.get_running_loop().run_in_executor(
                self.lane, self.sender.send, slot, hidden, timeout_s)
        except (TransferError, ValueError):
            self.free.add(slot)
            metrics().error(self.sender.path, "hidden")
            raise
        self.sent[self.sender.path] = self.sent.get(self.sender.path, 0) + n
        metrics().moved("hidden", self.sender.path, n)
        self.mail.send(self.inbox, StageStep(head_epoch, step, slot, hidden.shape[0],
                                             str(hidden.dtype).removeprefix("torch."), parts))
        return waited

    def close(self) -> None:
        self.lane.shutdown(wait=False)
        if self.sender is not None:
            self.sender.close()


@dataclass
class Outcome:
    """What the followers reported for one request, merged."""

    ok: bool = True
    error: str = ""
    kv_bytes: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    first: list[SampledToken] = field(default_factory=list)  # the last stage's tokens
    invalid: str = ""  # why a stage failed it for its own fault: a 400, not a 503
    stages: set[int] = field(default_factory=set)

    def add(self, msg: StageReport) -> None:
        self.stages.add(msg.stage)
        self.ok = self.ok and msg.ok
        self.error = self.error or msg.error
        self.kv_bytes += msg.kv_bytes
        self.compute_s += msg.compute_s
        self.wait_s += msg.wait_s
        if msg.invalid and not self.invalid:
            self.invalid = msg.error or "the request's grammar failed"
        if msg.first:
            self.first = msg.first

    def check(self) -> None:
        """Raise unless every stage did its part and the last sampled: GrammarError (a
        400: the request's own grammar failed) or TransferError (a 503)."""
        if self.invalid:
            raise GrammarError(self.invalid)
        if not self.ok or not self.first:
            raise TransferError(self.error or "a pipeline stage failed")


@dataclass
class Follower:
    epoch: int
    inbox: str
    last_hello: float  # monotonic
    following: bool  # it follows this head (its hello names our epoch)
    kv_bytes: dict[str, int] = field(default_factory=dict)  # its latest hello's


class Followers:
    """The head's book of its followers (stages 1..S-1)."""

    def __init__(self, stages: int, epoch: int, timeout_s: float) -> None:
        self.stages = stages
        self.epoch = epoch
        self.timeout_s = timeout_s  # a follower silent twice this long is lost
        self.members: dict[int, Follower] = {}
        self.waiting: dict[tuple[str, Fence], tuple[Outcome, asyncio.Future[Outcome]]] = {}

    @property
    def ready(self) -> bool:
        """Every follower follows this head: tasks can be taken."""
        return len(self.members) == self.stages - 1 and all(
            f.following for f in self.members.values())

    def on_hello(self, msg: StageHello) -> None:
        known = self.members.get(msg.stage)
        if known is not None and known.epoch != msg.epoch and known.following:
            raise StageLost(f"stage {msg.stage} restarted (epoch {known.epoch} → {msg.epoch})")
        if not 0 < msg.stage < self.stages:
            log.warning("hello from stage %d of a %d-stage group: ignored", msg.stage,
                        self.stages)
            return
        if known is None or not known.following:
            log.info("stage %d (%s) %s", msg.stage, msg.inbox,
                     "follows" if msg.head_epoch == self.epoch else "joined")
        self.members[msg.stage] = Follower(msg.epoch, msg.inbox, time.monotonic(),
                                           msg.head_epoch == self.epoch, msg.kv_bytes)

    def kv_bytes(self, own: dict[str, int]) -> dict[str, int]:
        """The group's bytes moved, by flow/path: the head's ``own`` plus what each
        follower said in its latest hello (the head's heartbeat reports the group)."""
        out = Counter(own)
        for f in self.members.values():
            out.update(f.kv_bytes)
        return dict(out)

    def check(self) -> None:
        """Raise ``StageLost`` when a follower that followed us fell silent."""
        now = time.monotonic()
        for stage, f in self.members.items():
            if f.following and now - f.last_hello > 2 * self.timeout_s:
                raise StageLost(f"stage {stage} silent for {now - f.last_hello:.1f}s")

    def beat(self, mail: Mailbox, inboxes: list[str]) -> None:
        for inbox in inboxes:
            mail.send(inbox, StageBeat(self.epoch))

    def expect(self, request_id: str, fence: Fence) -> asyncio.Future[Outcome]:
        """Resolved once every follower reported the request."""
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.waiting[(request_id, fence)] = (Outcome(), fut)
        return fut

    def on_report(self, msg: StageReport) -> None:
        if msg.head_epoch != self.epoch:
            return
        entry = self.waiting.get((msg.request_id, msg.fence))
        if entry is None:
            return
        outcome, fut = entry
        outcome.add(msg)
        if len(outcome.stages) == self.stages - 1:
            del self.waiting[(msg.request_id, msg.fence)]
            if not fut.done():
                fut.set_result(outcome)

    def forget(self, request_id: str, fence: Fence) -> None:
        self.waiting.pop((request_id, fence), None)


class HeadGroup:
    """The head's side of its group: beats and hellos, the handoff to stage 1, what each
    request waits for from the followers, and aborts."""

    def __init__(self, rt: "WorkerRuntime", index: int) -> None:
        cfg = rt.config
        place = cfg.prefill_place(index)
        self.rt = rt
        self.epoch = rt.epoch
        self.inboxes = [cfg.inbox("prefill", place.head + k) for k in range(1, place.stages)]
        self.followers = Followers(place.stages, rt.epoch, cfg.heartbeat_timeout_s)
        self.next = NextStage(rt.mail, rt.transfer, cfg.kv_path, self.inboxes[0])
        self.timeout_s = cfg.heartbeat_timeout_s
        self.lost: Optional[StageLost] = None
        self.handlers = {StageHello: self.on_hello, StageAck: self.next.on_ack,
                         StageReport: self.followers.on_report}

    def moved(self, own: "KVPaths", mover: Optional["RangeMover"]) -> dict[str, int]:
        """The group's bytes moved, by flow/path: the head's (its streams, ``mover``'s
        store I/O, the hidden states it sent) and its followers'."""
        return self.followers.kv_bytes(own.moved(mover, self.next.sent))

    def on_hello(self, msg: StageHello) -> None:
        try:
            self.followers.on_hello(msg)
        except StageLost as exc:
            self.lost = exc
            return
        if msg.stage == 1:
            self.next.on_hello(msg)

    async def beat_loop(self) -> None:
        """Beat every interval; end the process (the group restarts) when a stage is lost."""
        while True:
            self.followers.beat(self.rt.mail, self.inboxes)
            if self.lost is None:
                try:
                    self.followers.check()
                except StageLost as exc:
                    self.lost = exc
            if self.lost is not None:
                log.error("%s: %s: restarting the group", self.rt.instance_id, self.lost)
                raise self.lost
            await asyncio.sleep(self.rt.config.heartbeat_interval_s)

    @staticmethod
    def part(task: "PrefillTask", plan: "PrefixPlan", start: int, end: int, opened: bool,
             io: "PartIO") -> StagePart:
        """What the followers compute of a job's chunk, as computed by the head."""
        opening = None if opened else PartOpen(task.target, plan.cached_blocks, plan.load,
                                               plan.load_from)
        last = end == len(task.token_ids)
        return StagePart(task.request_id, task.fence, len(task.token_ids), start, end,
                         plan.block_table, task.deadline, opening, io.put, io.put_blocks,
                         task.sampling if last else None, poisoned=io.poisoned,
                         adapter=task.sampling.adapter)

    async def ship(self, step: int, hidden: torch.Tensor, parts: list[StagePart]) -> float:
        try:
            return await self.next.ship(self.epoch, step, hidden, parts, 2 * self.timeout_s)
        except (TransferError, ValueError) as exc:
            self.lost = StageLost(f"stage 1 did not take step {step}: {exc}")
            raise self.lost

    def expect(self, task: "PrefillTask") -> asyncio.Future[Outcome]:
        return self.followers.expect(task.request_id, task.fence)

    async def result(self, fut: asyncio.Future[Outcome], deadline: float) -> Outcome:
        """Every follower's report; TransferError when one failed or none came in time,
        GrammarError when the last stage could not compile the request's grammar."""
        try:
            outcome = await asyncio.wait_for(asyncio.shield(fut), max(1.0, deadline - time.time()))
        except asyncio.TimeoutError:
            raise TransferError("the pipeline stages did not finish by the deadline") from None
        outcome.check()
        return outcome

    def abort(self, task: "PrefillTask") -> asyncio.Future[Outcome]:
        """Tell every follower to drop the request; resolved once all have settled."""
        entry = self.followers.waiting.get((task.request_id, task.fence))
        fut = entry[1] if entry is not None else self.expect(task)
        for inbox in self.inboxes:
            self.rt.mail.send(inbox, StageAbort(self.epoch, task.request_id, task.fence))
        return fut

    async def settled(self, fut: asyncio.Future[Outcome]) -> bool:
        """Wait for the followers' reports after an abort. A follower that does not answer
        in time is lost: the group restarts (and until then, nothing is freed)."""
        try:
            await asyncio.wait_for(asyncio.shield(fut), 2 * self.timeout_s)
            return True
        except asyncio.TimeoutError:
            self.lost = StageLost("a stage did not settle an aborted request in time")
            return False

    def close(self) -> None:
        self.next.close()
