"""The conductor's failure paths: ending a request with an error, aborting its workers,
and the failure policy on a lost worker (``tracker.Loss``): fail, resume, detach or re-run
each request it held, a re-run placed again at once or held for a worker to come back.

A mixin of ``Conductor`` (services/conductor/service.py) that adds behaviour, no state:
every field it uses is the conductor's, listed below, and a re-run is reserved through
the conductor's ``_reserve`` like a first placement.
"""
from __future__ import annotations

import logging
from typing import Callable, Union

from common.mailbox import Mailbox
from common.protocol import AbortRequest, RequestFailed, SubmitRequest, WorkerLeaving
from common.scheduling import NO_INSTANCES, Rejection
from services.conductor.held import HeldRequests
from services.conductor.metrics import ConductorMetrics
from services.conductor.placement import Placement, Placer
from services.conductor.registry import Registry
from services.conductor.tracker import Phase, Tracked, Tracker

log = logging.getLogger("conductor")


class FailurePaths:
    # the Conductor's fields these methods use
    mail: Mailbox
    router_inbox: str
    router_inboxes: tuple[str, ...]
    clock: Callable[[], float]
    registry: Registry
    tracker: Tracker
    held: HeldRequests
    placer: Placer
    metrics: ConductorMetrics

    def reply_to(self, req: SubmitRequest) -> str:
        """The inbox of the router that took ``req``: the one it names where the cluster
        has that router, else the first router's."""
        return req.router_inbox if req.router_inbox in self.router_inboxes \
            else self.router_inbox

    def fail(self, t: Tracked, status: int, kind: str, text: str,
             retry_after: float | None = None, abort: bool = True,
             resumable: bool = False) -> None:
        self.tracker.pop(t.req.request_id)
        if abort:
            self._abort_workers(t, kind)
        else:
            self.registry.release(t)
        self.metrics.failed.labels(reason=kind).inc()
        self.mail.send(self.reply_to(t.req), RequestFailed(
            t.req.request_id, status, kind, text, retry_after, resumable=resumable))

    def _abort_workers(self, t: Tracked, reason: str) -> None:
        for wid in {t.prefill_id, t.decode_id}:
            w = self.registry.get(wid)
            if w is not None:
                self.mail.send(w.info.inbox, AbortRequest(t.req.request_id, reason, t.fence))
        self.registry.release(t)

    def on_leaving(self, msg: WorkerLeaving) -> None:
        w = self.registry.get(msg.instance_id)
        if w is not None and w.info.epoch == msg.epoch:
            del self.registry.workers[msg.instance_id]
            log.info("%s left (SIGTERM)", msg.instance_id)
            self.worker_lost(msg.instance_id, "shut down")

    def worker_lost(self, instance_id: str, why: str) -> None:
        """Apply the failure policy (``tracker.Loss``) to the requests on a lost worker."""
        loss = self.tracker.lost(instance_id)
        for t, what in loss.fail:
            self.fail(t, 503, "worker_lost", f"{what}: {instance_id} {why}")
        for t in loss.resume:
            what = "mid-stream" if t.phase is Phase.DECODING else "during its prefill"
            self.fail(t, 503, "worker_lost", f"decode worker lost {what}: {instance_id} "
                      f"{why}", resumable=True)
        for t in loss.detach:
            self.registry.release_prefill(t)
        for t in loss.rerun:
            role = "decode" if t.decode_id == instance_id else "prefill"
            self.rerun(t, f"{role} worker lost ({instance_id} {why})")

    def rerun(self, t: Tracked, why: str, kind: str = "worker_lost",
              store_loads: bool = True) -> None:
        """Its prefill worker was lost (or its group's store load failed) before the first
        token: place the request again, once, unseen by the client. The old reservation is
        aborted: its blocks stay in the decode worker's quarantine until the old writer is
        known to have stopped. ``store_loads`` False (after a failed store load): the re-run
        loads nothing from the store (what failed once over a path may fail again) and
        computes past the local prefix."""
        self.tracker.pop(t.req.request_id)
        self._abort_workers(t, "prefill_lost")
        store_loads = t.store_loads and store_loads
        decision = self.placer.place(t.req, self.registry, self.clock(), self.tracker,
                                     store_loads)
        if isinstance(decision, Rejection) and decision.reason == NO_INSTANCES and \
                self.held.hold(t.req, t.attempt + 1, t.accepted_at, store_loads):
            return  # the worker's restart (or another) takes it: place_held
        self._place_again(t.req, decision, t.attempt + 1, t.accepted_at, store_loads, why,
                          kind)

    def _place_again(self, req: SubmitRequest, decision: Union[Placement, Rejection],
                     attempt: int, accepted_at: float, store_loads: bool, why: str,
                     kind: str = "worker_lost") -> None:
        """A re-run's placement, or its failure: the client was told it was accepted."""
        if isinstance(decision, Rejection):
            self.metrics.failed.labels(reason=kind).inc()
            self.mail.send(self.reply_to(req), RequestFailed(
                req.request_id, 503, kind, f"{why}, and no re-run possible: {decision.reason}"))
            return
        log.info("%s: %s; re-run on %s", req.request_id, why, decision.prefill_id)
        self.metrics.reruns.inc()
        self._reserve(req, decision, attempt=attempt, accepted_at=accepted_at,
                      store_loads=store_loads)
