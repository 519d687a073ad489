"""One request's life in the router after validation: submit, await events, account.

Every wait has a deadline (``request_timeout_s``); a silent request becomes a 504 and is
aborted at the conductor. Failures from the cluster become ``ApiError`` with the status the
conductor chose; a rejection becomes a 429 whose code is the policy's reason and whose
Retry-After is the policy's retry time. With the conductor lost (``RouterState.
conductor_lost``) a new request is a 503 at once, and one already waiting fails with a 503
within a heartbeat of the loss rather than at its deadline; a draining router (SIGTERM)
takes no new request.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Optional, Union

from common import timeline
from common.protocol import (RequestAccepted, RequestFailed, RequestRejected, SubmitRequest,
                             TokenDelta)
from services.router.errors import ApiError
from services.router.resume import Resumable
from services.router.state import RequestEvent, RouterState

log = logging.getLogger(__name__)

_PASS_THROUGH = {400, 413, 429, 500, 503, 504}


def failure_error(msg: Union[RequestFailed, RequestRejected]) -> ApiError:
    if isinstance(msg, RequestRejected):
        r = msg.rejection
        return ApiError(429, f"request rejected ({r.reason}): {r.detail or r.reason}",
                        code=r.reason, retry_after_s=r.retry_after_s)
    status = msg.status if msg.status in _PASS_THROUGH else 500
    retry = msg.retry_after_s if status in (429, 503) else None
    if status == 429 and retry is None:
        retry = 1.0
    return ApiError(status, msg.message, code=msg.error_type, retry_after_s=retry)


class RequestRun:
    """Events of one submitted request, with deadlines and metrics."""

    def __init__(self, state: RouterState, endpoint: str, req: SubmitRequest) -> None:
        self.state = state
        self.endpoint = endpoint
        self.request_id = req.request_id  # the client's (metrics, the dashboard)
        self.cluster_id = req.request_id  # the cluster's: a continuation's after a resume
        self.resumable = Resumable(req)  # services/router/resume.py
        self.arrival = req.arrival_time
        self.model = req.sampling.adapter or state.config.model_name  # metrics' label
        self.timeout = state.config.request_timeout_s
        self.done = False
        self.open_choices = req.sampling.n  # each ends with a delta with a finish reason
        self.status = 500  # the HTTP status counted at the end
        self._pending: Optional[TokenDelta] = None
        self.accepted = False
        self._last_token: Optional[float] = None
        self._last_word = time.monotonic()  # the last event about this request
        state.requests.arrived(self.request_id, endpoint, self.arrival, self.model)
        state.metrics.in_flight.inc()
        try:
            refusal = self._refusal()
            if refusal is not None:
                raise refusal
            timeline.mark("router_sent", req.request_id, len(req.token_ids))
            self.queue = state.submit(req)
        except ConnectionError as exc:
            self.done = True
            self.finish(503)
            raise ApiError(503, str(exc), code="conductor_unavailable") from exc
        except ApiError:
            self.done = True
            self.finish(503)
            raise

    def _refusal(self) -> Optional[ApiError]:
        if self.state.draining:
            return ApiError(503, "the router is shutting down", code="draining",
                            retry_after_s=1.0)
        return self._lost()

    def _lost(self) -> Optional[ApiError]:
        silent = self.state.conductor_lost()
        if silent is None:
            return None
        return ApiError(503, f"the cluster is unavailable: no word from the conductor for "
                        f"{silent:.1f} s", code="cluster_unavailable", retry_after_s=1.0)

    def _orphaned(self) -> Optional[ApiError]:
        """The conductor was replaced after this request's last event, and nothing came
        within the grace: the new one does not know it, so nothing will."""
        restarted, grace = self.state.restarted_at, self.state.orphan_grace_s
        if restarted is None or self._last_word > restarted or \
                time.monotonic() - restarted < grace:
            return None
        return ApiError(503, f"the conductor restarted and this request made no progress for "
                        f"{grace:g} s after it", code="conductor_restarted", retry_after_s=1.0)

    async def _next(self) -> RequestEvent:
        msg = await self._wait()
        self._last_word = time.monotonic()
        return msg

    async def _wait(self) -> RequestEvent:
        queue = self.queue
        if not queue.empty():  # the common case while streaming: no timer needed
            return queue.get_nowait()
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self.timeout
        config = self.state.config
        while (left := deadline - loop.time()) > 0:
            try:  # look for a lost conductor every heartbeat
                async with asyncio.timeout(min(left, config.heartbeat_interval_s)):
                    return await queue.get()
            except TimeoutError:
                lost = self._lost() or self._orphaned()
                # A decode worker streams without the conductor: only its silence counts.
                streaming = self._last_token is not None and \
                    loop.time() - start <= config.heartbeat_timeout_s
                if lost is not None and not streaming:
                    self.state.abort(self.cluster_id, "conductor lost")
                    self.done = True
                    raise lost from None
        self.state.abort(self.cluster_id, "router timeout")
        self.done = True
        raise ApiError(504, f"no response from the cluster within {self.timeout:g} s",
                       code="timeout")

    def _accepted(self, msg: RequestAccepted) -> None:
        """The first acceptance of this run (a re-run's or a continuation's come again)."""
        if self.accepted:
            return
        self.accepted = True
        now = time.time()
        self.state.metrics.queue_time.observe(max(0.0, now - self.arrival))
        self.state.requests.accepted(msg, now)

    def _delta(self, msg: TokenDelta) -> None:
        now = time.time()
        metrics = self.state.metrics
        if self._last_token is None:
            timeline.mark("router_first", self.cluster_id)
            metrics.ttft.labels(self.model).observe(max(0.0, now - self.arrival))
            metrics.generation_tokens.inc(len(msg.token_ids))
        else:
            metrics.observe_tokens(now - self._last_token, len(msg.token_ids))
        self._last_token = now
        self.state.requests.tokens(self.request_id, len(msg.token_ids), now)

    def _screen(self, msg: RequestEvent) -> bool:
        """Raise for a failure or rejection; record an acceptance (True); False for a token
        delta."""
        if isinstance(msg, RequestFailed) and self._resume(msg):
            return True
        if isinstance(msg, (RequestFailed, RequestRejected)):
            self.done = True
            raise failure_error(msg)
        if isinstance(msg, RequestAccepted):
            self._accepted(msg)
            return True
        return False

    def _resume(self, failure: RequestFailed) -> bool:
        """Go on with a continuation where ``failure`` allows one (resume.py): submitted
        now, its events come in this run's place."""
        submit = self.resumable.continuation(failure, self.state.block_keys)
        if submit is None:
            return False
        self.state.close(self.cluster_id)
        try:
            self.queue = self.state.submit(submit)
        except ConnectionError:
            return False  # the conductor's inbox is gone: the failure stands
        self.cluster_id = submit.request_id
        self.state.metrics.resumed.inc()
        log.info("%s: %s; going on as %s after %d tokens", self.request_id, failure.message,
                 submit.request_id, len(submit.sampling.resumed))
        return True

    async def wait_started(self) -> None:
        """Return once the conductor accepted the request (or its first token came)."""
        msg = await self._next()
        if not self._screen(msg):
            self._pending = msg  # a token came first: keep it for deltas()

    async def deltas(self) -> AsyncIterator[TokenDelta]:
        """Token deltas, of every choice, until each choice's with a finish reason;
        failures raise ``ApiError``."""
        while True:
            if self._pending is not None:
                msg: RequestEvent = self._pending
                self._pending = None
            else:
                msg = await self._next()
            if self._screen(msg):
                continue
            self._delta(msg)
            if msg.index == 0:
                self.resumable.record(msg)
            if msg.finish_reason is not None:
                self.open_choices -= 1
                self.done = self.open_choices == 0
            yield msg
            if self.done:
                return

    def finish(self, status: int, usage: Optional[tuple[int, int]] = None,
               abort_reason: str = "client disconnected") -> None:
        """Count the request once; abort it at the conductor if it did not end."""
        if not self.done:
            self.state.abort(self.cluster_id, abort_reason)
            self.done = True
        self.state.close(self.cluster_id)
        self.state.requests.finished(self.request_id, status, usage, time.time())
        metrics = self.state.metrics
        metrics.requests.labels(self.endpoint, str(status), self.model).inc()
        metrics.in_flight.dec()
        if status == 200:
            metrics.e2e.labels(self.model).observe(max(0.0, time.time() - self.arrival))
        if usage is not None:
            metrics.prompt_tokens.inc(usage[0])
            metrics.cached_tokens.inc(usage[1])
