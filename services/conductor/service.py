"""The conductor process: registry, admission, placement, and the request state machine.

Flow for one request (see docs/lifecycle.md):
  SubmitRequest → place (policy) → ReserveBlocks to decode → BlocksReserved
  → PrefillTask to prefill → PrefillDone → (decode streams) → RequestFinished.
Any failure answers the router with RequestFailed and aborts the other worker
(services/conductor/failures.py); a request that finds no worker waits for one
(services/conductor/held.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

from common import timeline
from common.config import ClusterConfig
from common.mailbox import Mailbox, serve_inbox
from common.protocol import (
    KV_FAILED, AbortRequest, BlocksReserved, KVResync, KVSnapshot, PrefetchLoads, PrefillDone,
    PrefillTask, ReRegister, RegisterWorker, RequestAccepted, RequestFailed, RequestFinished,
    RequestRejected, ReserveBlocks, ReserveFailed, SubmitRequest, WorkerGone,
    WorkerHeartbeat, WorkerLeaving,
)
from common.status_protocol import ClusterStatus, PrefillSummary
from common.scheduling import NO_INSTANCES, Rejection
from services.conductor.failures import FailurePaths
from services.conductor.held import HeldRequests
from services.conductor.metrics import ConductorMetrics
from services.conductor.placement import Placement, Placer
from services.conductor.registry import ROLES, Registry
from services.conductor.status import StoreView, conductor_totals
from services.conductor.store_events import StoreEventFeed
from services.conductor.tracker import Phase, Tracked, Tracker
from services.conductor.ttft_log import TTFTRecord

log = logging.getLogger("conductor")

RESERVE_TIMEOUT_S = 10.0
# A group head's refusal (``prefill_stage_down``) costs no work: a request re-runs after
# it while it has had fewer attempts than this (a lost worker's re-run is attempt 1).
STAGE_DOWN_RERUNS = 3


class Conductor(FailurePaths):
    def __init__(self, config: ClusterConfig, mailbox: Mailbox,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.mail = mailbox
        self.clock = clock  # wall clock of placement, accept, decode start and finish
        self.epoch = time.time_ns()  # this incarnation (ClusterStatus tells the router)
        self.registry = Registry(config.heartbeat_timeout_s)
        self.tracker = Tracker()
        self.held = HeldRequests(config.worker_wait_s)  # waiting for a worker (place_held)
        self.placer = Placer(config)
        self.metrics = ConductorMetrics()
        self.metrics.ttft_log.cost = self.placer.describe  # read by the metrics thread
        self.metrics.typical_decode.set(self.placer.policy.decode_durations.mean())
        self.router_inbox = config.inbox("router")  # the first router's
        self.router_inboxes = tuple(config.inbox("router", i) for i in range(config.routers))
        self.store: Optional[StoreView] = None  # the store's usage, with a store (run)
        self.prefilled: list[PrefillSummary] = []  # since the last ClusterStatus (sweep)
        self.handlers: dict[type, Callable[[Any], None]] = {
            RegisterWorker: self.on_register,
            WorkerHeartbeat: self.on_heartbeat,
            KVSnapshot: self.on_kv_snapshot,
            SubmitRequest: self.on_submit,
            AbortRequest: self.on_abort,
            BlocksReserved: self.on_reserved,
            ReserveFailed: self.on_reserve_failed,
            PrefillDone: self.on_prefill_done,
            RequestFinished: self.on_finished,
            RequestFailed: self.on_failed,
            WorkerLeaving: self.on_leaving,
        }

    # ------------------------------------------------------------ registry
    def on_register(self, msg: RegisterWorker) -> None:
        if msg.role not in ROLES:
            log.warning("ignoring registration with role %r", msg.role)
            return
        old = self.registry.get(msg.instance_id)
        if old is not None and msg.epoch < old.info.epoch:
            log.info("dropped a registration of a replaced %s", msg.instance_id)
            return
        if self.registry.register(msg) is old:
            return  # the periodic registration of a known incarnation
        log.info("registered %s (%s, %d blocks)", msg.instance_id, msg.role, msg.num_blocks)
        if msg.cost is not None and self.placer.adopt(msg.cost):
            log.info("pricing with the cost %s fitted on its machine: %s %s",
                     msg.instance_id, msg.cost.prefill or "", msg.cost.decode or "")
        if old is not None:  # a new incarnation replaced it: its requests are gone
            self.worker_lost(msg.instance_id, "restarted")
        self._announce(msg)
        self.place_held()

    def _announce(self, msg: RegisterWorker) -> None:
        """Tell decode workers that every other incarnation of ``msg``'s worker is gone
        (it bound the same inbox), so the blocks they quarantined for its writes are free;
        a decode worker new here learns it of every worker known."""
        decodes = [w for w in self.registry.workers.values() if w.info.role == "decode"]
        for w in decodes:
            self.mail.send(w.info.inbox, WorkerGone(msg.instance_id, msg.epoch))
        if msg.role == "decode":
            for w in self.registry.workers.values():
                if w.instance_id != msg.instance_id:
                    self.mail.send(msg.inbox, WorkerGone(w.instance_id, w.info.epoch))

    def on_heartbeat(self, msg: WorkerHeartbeat) -> None:
        if not self.registry.heartbeat(msg):
            if msg.inbox:
                log.info("heartbeat from unknown %s: asking it to register", msg.instance_id)
                self.mail.send(msg.inbox, ReRegister(msg.instance_id))
            return
        self.metrics.observe_worker(msg.instance_id, msg.dropped, msg.load.quarantined,
                                    msg.kv_bytes)
        if self.placer.decode_steps.observe(msg.instance_id, msg.epoch, msg.decode_steps):
            self.metrics.cost_refits.inc()

    def on_kv_snapshot(self, msg: KVSnapshot) -> None:
        if not self.registry.kv_snapshot(msg):
            log.debug("dropped a stale KV snapshot of %s", msg.instance_id)

    def ready(self) -> bool:
        return bool(self.registry.by_role("prefill")) and bool(self.registry.by_role("decode"))

    # ------------------------------------------------------------ admission and placement
    def reject(self, req: SubmitRequest, rejection: Rejection) -> None:
        """Refuse before any work: the router answers 429 with the reason and retry time."""
        self.metrics.rejected.labels(reason=rejection.reason).inc()
        self.mail.send(self.reply_to(req), RequestRejected(req.request_id, rejection))

    def on_submit(self, req: SubmitRequest) -> None:
        timeline.mark("conductor_in", req.request_id)
        if req.request_id in self.tracker.requests:
            log.warning("duplicate request id %s", req.request_id)
            return
        if self.tracker.waiting_for_prefill() + len(self.held) >= self.config.max_queue:
            return self.reject(req, Rejection("queue_full", 1.0, (
                f"{self.config.max_queue} requests are waiting for prefill")))
        if not self.ready():
            if self.held.hold(req):
                return
            self.metrics.rejected.labels(reason="service_unavailable").inc()
            self.mail.send(self.reply_to(req), RequestFailed(
                req.request_id, 503, "service_unavailable", "no prefill or decode worker"))
            return
        start = time.perf_counter()
        decision = self.placer.place(req, self.registry, self.clock(), self.tracker)
        self.metrics.decision_seconds.observe(time.perf_counter() - start)
        if isinstance(decision, Rejection):
            return self.reject(req, decision)
        self.dispatch(req, decision)

    def dispatch(self, req: SubmitRequest, p: Placement) -> None:
        """Place ``req``: the router hears it accepted once its decode blocks are reserved
        (``on_reserved``), so a reservation that fails is a plain 429, not an error event
        in a stream already answered 200."""
        self._reserve(req, p, attempt=0, accepted_at=self.clock())
        self.metrics.placed.labels(prefill=p.prefill_id, decode=p.decode_id).inc()
        self.metrics.predicted_ttft.observe(p.predicted_ttft_s)

    def _reserve(self, req: SubmitRequest, p: Placement, attempt: int,
                 accepted_at: float, store_loads: bool = True) -> None:
        """Track the request on its placement and ask its decode worker for blocks."""
        decode = self.registry.get(p.decode_id)
        prefill = self.registry.get(p.prefill_id)
        assert decode is not None and prefill is not None
        now = time.monotonic()
        tracked = Tracked(req=req, prefill_id=p.prefill_id, decode_id=p.decode_id,
                          phase=Phase.RESERVING, phase_deadline=now + RESERVE_TIMEOUT_S,
                          predicted_ttft_s=p.predicted_ttft_s, accepted_at=accepted_at,
                          prefill_tokens=p.prefill_tokens,
                          decode_tokens=p.kv_tokens,
                          attempt=attempt, store_loads=store_loads)
        waiting = self.placer.waiting(prefill, self.tracker)
        for t in waiting:
            t.alone = False
        tracked.alone = not waiting and attempt == 0
        self.tracker.add(tracked)
        self.registry.assign(tracked)
        self.mail.send(decode.info.inbox, ReserveBlocks(
            request_id=req.request_id, prompt_tokens=len(req.token_ids),
            sampling=req.sampling, router_inbox=self.reply_to(req),
            deadline=time.time() + self.config.kv_wait_timeout_s, epoch=decode.info.epoch,
            writer=prefill.instance_id, writer_epoch=prefill.info.epoch, attempt=attempt,
            writer_inbox=prefill.info.inbox))
        timeline.mark("placed", req.request_id)
        if p.store_blocks and self.config.kv_layerwise and prefill.info.role == "prefill":
            # its worker asks the store where the prefix is while the reservation goes
            # round: that answer (3.4 ms for 1,024 keys here) is off the prompt's path
            self.mail.send(prefill.info.inbox, PrefetchLoads(req.request_id, req.block_keys))

    def on_reserved(self, msg: BlocksReserved) -> None:
        timeline.mark("reserved", msg.request_id)
        t = self.tracker.get(msg.request_id)
        if t is None or t.phase is not Phase.RESERVING or msg.attempt != t.attempt \
                or msg.instance_id != t.decode_id:
            # Aborted or re-run meanwhile: give these blocks (only these) back.
            worker = self.registry.get(msg.instance_id)
            if worker is not None:
                self.mail.send(worker.info.inbox,
                               AbortRequest(msg.request_id, "stale", msg.fence))
            return
        t.fence, t.reserved_at = msg.fence, self.clock()
        decode = self.registry.get(t.decode_id)
        prefill = self.registry.get(t.prefill_id)
        if decode is None or prefill is None:
            return self.fail(t, 503, "worker_lost", "a worker left before prefill started")
        p, d = prefill.info, decode.info
        if (p.block_nbytes, p.layer_nbytes) != (d.block_nbytes, d.layer_nbytes):
            return self.fail(t, 500, "kv_layout_mismatch", (
                f"{p.instance_id} writes {p.block_nbytes}-byte KV blocks, {d.instance_id} "
                f"holds {d.block_nbytes}-byte ones: workers must agree on model, block_size "
                "and kv_dtype"))
        self.tracker.set_phase(t, Phase.PREFILLING,
                               time.monotonic() + self.config.kv_wait_timeout_s)
        self.mail.send(self.reply_to(t.req), RequestAccepted(  # a re-run's too: the router
            t.req.request_id, t.prefill_id, t.decode_id, t.predicted_ttft_s))  # keeps one
        timeline.mark("task_sent", t.req.request_id)
        self.mail.send(prefill.info.inbox, PrefillTask(
            request_id=t.req.request_id, token_ids=t.req.token_ids,
            block_keys=t.req.block_keys, sampling=t.req.sampling,
            decode_id=decode.instance_id, decode_inbox=decode.info.inbox,
            decode_session=decode.info.transfer_session, decode_kv_base=decode.info.kv_base,
            decode_block_ids=msg.block_ids,
            deadline=time.time() + self.config.kv_wait_timeout_s,
            decode_shm_path=d.kv_shm_path, decode_host_id=d.host_id, fence=msg.fence,
            prefill_epoch=p.epoch, store_loads=t.store_loads, decode_kv_ipc=d.kv_ipc))

    def on_reserve_failed(self, msg: ReserveFailed) -> None:
        t = self.tracker.get(msg.request_id)
        if t is not None and (msg.attempt, msg.instance_id) == (t.attempt, t.decode_id):
            self.fail(t, 429, "kv_capacity", f"decode KV memory is full ({msg.reason})",
                      retry_after=1.0, abort=False)

    def on_prefill_done(self, msg: PrefillDone) -> None:
        t = self.tracker.get(msg.request_id)
        if t is not None and msg.fence != t.fence:  # an older attempt's writer
            return
        # What the prefill measured holds even when the request already ended (a one-token
        # answer's RequestFinished can overtake its PrefillDone): count it either way.
        self._observe_prefill(msg)
        if t is None:
            return self._calibrate(msg, None)
        self.tracker.set_phase(t, Phase.DECODING, t.phase_deadline)
        t.decode_started_at = self.clock()
        self.registry.release_prefill(t)
        self._calibrate(msg, t.decode_started_at - t.accepted_at if t.alone else None)
        self.metrics.observe_ttft(TTFTRecord(
            t.req.request_id, t.accepted_at, t.predicted_ttft_s,
            t.decode_started_at - t.accepted_at, len(t.req.token_ids), t.prefill_tokens,
            reserve_s=(t.reserved_at or t.accepted_at) - t.accepted_at,
            cached_tokens=msg.cached_tokens, compute_s=msg.prefill_seconds,
            wait_s=msg.wait_s, admit_s=msg.admit_s))

    def _calibrate(self, msg: PrefillDone, alone_ttft_s: Optional[float]) -> None:
        worker = self.registry.get(msg.instance_id)
        if self.placer.observe_prefill(msg, worker.info.stages if worker else 1, alone_ttft_s):
            self.metrics.cost_refits.inc()

    def _observe_prefill(self, msg: PrefillDone) -> None:
        self.metrics.cached_tokens.inc(msg.cached_tokens)
        self.metrics.global_hit_tokens.inc(msg.global_hit_tokens)
        self.metrics.prompt_tokens.inc(msg.prompt_tokens)
        self.metrics.transfer_bytes.inc(msg.transfer_bytes)
        self.metrics.transfer_seconds.observe(msg.transfer_seconds)
        self.metrics.prefill_compute.labels(msg.instance_id).observe(msg.prefill_seconds)
        self.metrics.prefill_transfer_wait.labels(msg.instance_id).observe(msg.wait_s)
        self.metrics.prefill_admission.labels(msg.instance_id).observe(msg.admit_s)
        self.prefilled.append(PrefillSummary(msg.request_id, msg.prefill_seconds, msg.wait_s,
                                             msg.transfer_seconds, msg.transfer_bytes))
        if msg.store_read_bytes:
            bandwidth = self.placer.observe_store_read(msg)
            if bandwidth is not None:
                self.metrics.store_read_bandwidth.set(bandwidth)

    def on_finished(self, msg: RequestFinished) -> None:
        t = self.tracker.get(msg.request_id)
        if t is None or msg.fence != t.fence:  # gone, or an older attempt's blocks freed
            return
        if msg.finish_reason == KV_FAILED:
            # The decode worker freed a reservation its prefill failed (KVFailed). The
            # prefill's own RequestFailed decides (fail or re-run): it was sent just after
            # the KVFailed but on another connection, so it may come second. Ending the
            # request here lost it (~1 run in 8 of a group's failed load). A prefill that
            # dies in between is a lost worker; its silence ends the request at its deadline.
            return
        self.tracker.pop(msg.request_id)
        self.registry.release(t)
        if t.decode_started_at is not None:
            policy = self.placer.policy
            policy.observe_decode(self.clock() - t.decode_started_at)
            self.metrics.typical_decode.set(policy.decode_durations.mean())
        self.metrics.finished.labels(reason=msg.finish_reason).inc()

    def on_failed(self, msg: RequestFailed) -> None:
        t = self.tracker.get(msg.request_id)
        if t is None or msg.fence not in (None, t.fence):  # gone, or an older attempt's
            return
        if msg.error_type == "kv_load_failed" and t.attempt == 0:
            # a pipeline group's store load failed (a lone worker computes the prefix
            # itself): the cache cost the attempt, not the request; re-run it once
            return self.rerun(t, msg.message, msg.error_type, store_loads=False)
        if msg.error_type == "prefill_stage_down" and t.attempt < STAGE_DOWN_RERUNS:
            # a group head refused it, nothing computed: a stage of its group died (the
            # head exits), or a restarted head registered before its stages came up
            # (the re-run after a lost worker lands there); until its heartbeat says so,
            # place nothing more on it, and re-run the request elsewhere
            self.registry.hold_off(t.prefill_id)
            return self.rerun(t, msg.message, msg.error_type)
        self.fail(t, msg.status, msg.error_type, msg.message, msg.retry_after_s)

    def on_abort(self, msg: AbortRequest) -> None:
        t = self.tracker.pop(msg.request_id)
        if t is not None:
            self._abort_workers(t, msg.reason)
        if t is not None or self.held.pop(msg.request_id) is not None:
            self.metrics.finished.labels(reason="abort").inc()

    # ------------------------------------------------------------ waiting for a worker
    def place_held(self) -> None:
        """Place the requests waiting for a worker, oldest first; fail those whose wait is
        over. A rejection other than a missing worker answers as it would have at once."""
        for h in self.held.expired(time.monotonic()):
            self.metrics.failed.labels(reason="worker_unavailable").inc()
            self.mail.send(self.reply_to(h.req), RequestFailed(
                h.req.request_id, 503, "worker_unavailable", "no prefill or decode worker "
                f"came back within {self.held.wait_s:g} s"))
        for h in self.held.oldest_first():
            decision = self.placer.place(h.req, self.registry, self.clock(), self.tracker,
                                         h.store_loads)
            if isinstance(decision, Rejection) and decision.reason == NO_INSTANCES:
                continue
            self.held.pop(h.req.request_id)
            if h.accepted_at is None and isinstance(decision, Rejection):
                self.reject(h.req, decision)
            elif h.accepted_at is None:
                self.dispatch(h.req, decision)
            else:
                self._place_again(h.req, decision, h.attempt, h.accepted_at, h.store_loads,
                                  "a worker it was placed on was lost")

    def sweep(self) -> None:
        """Expire silent workers and overdue requests; publish status."""
        for dead in self.registry.expire():
            log.warning("%s missed heartbeats for %.1fs; removing it", dead.instance_id,
                        self.config.heartbeat_timeout_s)
            self.worker_lost(dead.instance_id, "stopped responding")
        now = time.monotonic()
        for t in self.tracker.overdue(now):
            self.fail(t, 504, "timeout", f"request stuck in {t.phase.value}")
        self.place_held()
        for w in self.registry.kv_resyncs_due():  # KV events had a gap
            self.mail.send(w.info.inbox, KVResync(w.instance_id))
            self.metrics.kv_resyncs.inc()
        self.metrics.global_index_keys.set(len(self.placer.global_index))
        prefilled, self.prefilled = self.prefilled, []
        status = ClusterStatus(
            self.ready(), self.registry.status(), self.epoch,
            conductor_totals(self.metrics), self.store.usage() if self.store else None,
            prefilled)
        for inbox in self.router_inboxes:
            self.mail.send(inbox, status)
        self.metrics.update_gauges(self.registry, self.tracker)


async def run(config: ClusterConfig, index: int = 0) -> None:
    mail = Mailbox(config.inbox("conductor", bind=True), "conductor")
    conductor = Conductor(config, mail)
    conductor.metrics.serve(config.port("conductor_http"), config.listen_host("conductor"))

    async def ticker() -> None:
        while True:
            await asyncio.sleep(config.heartbeat_interval_s)
            conductor.sweep()

    tasks = [asyncio.create_task(ticker())]
    if config.store.enabled:
        feed = StoreEventFeed(config, conductor.placer.global_index)
        conductor.store = StoreView(config, feed.sync, max(1.0, config.heartbeat_interval_s))
        tasks += [asyncio.create_task(feed.run()), asyncio.create_task(conductor.store.run())]
    log.info("conductor ready at %s (scheduler=%s)", config.inbox("conductor"),
             config.scheduler)
    try:
        await serve_inbox(mail, conductor.handlers, tasks)
    finally:
        mail.close()
