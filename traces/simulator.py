"""Discrete-event simulator of a disaggregated cluster driving the real policy objects.

N prefill instances (FIFO queue each, an LRU cache of ``prefill_cache_tokens``), a global
pool (the store: an LRU over ``global_pool_tokens``), M decode instances (continuous
batching, KV memory of ``decode_capacity_tokens``, optionally a fixed ``decode_max_batch``).
A decode instance takes a request handed over after prefill only if it holds it and, with
a TBT SLO, its predicted TBT stays within the SLO; otherwise another one that can, else the
request is rejected after its prefill (the prefill time is spent). Each arrival is placed by a
``common.scheduling`` Scheduler exactly as the conductor would; prefill time, transfers and
decode steps come from the same CostModel. Blocks are the trace's 512-token blocks.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

from common.scheduling import (
    CostModel,
    DecodeInstanceState,
    DecodeSlot,
    LRUBlockCache,
    PrefillInstanceState,
    RequestInfo,
    ScheduleDecision,
    SchedulerConfig,
    make_scheduler,
)
from traces.batch import DecodeBatch
from traces.loader import TRACE_BLOCK_TOKENS, TraceRequest
from traces.metrics import (
    COMPLETED,
    REJECTED_AFTER_PREFILL,
    REJECTED_ARRIVAL,
    RequestRecord,
    SimResult,
)

_ARRIVAL, _PREFILL_DONE, _STEP_END = 0, 1, 2
DECODE_TIME_MODES = ("empirical", "mean", "fixed", "oracle")


@dataclass
class ClusterConfig:
    num_prefill: int = 8
    num_decode: int = 8
    prefill_cache_tokens: int = 3_000_000
    global_pool_tokens: Optional[int] = None      # None: num_prefill * prefill_cache_tokens
    decode_capacity_tokens: Optional[int] = None  # None: the cost model's kv_capacity_tokens
    decode_max_batch: Optional[int] = None        # None: KV memory only bounds the batch
    # After prefill the KV goes to the decode instance chosen at arrival ("assigned", the
    # paper's Algorithm 1 picks both and streams KV to it), or to any that can take it ("any").
    decode_handoff: str = "assigned"


@dataclass
class _Job:
    req: TraceRequest
    info: RequestInfo
    decision: ScheduleDecision
    predicted_s: float


class _Prefill:
    def __init__(self, iid: str, cache_blocks: int) -> None:
        self.iid = iid
        self.cache = LRUBlockCache(cache_blocks)
        self.queue: deque[_Job] = deque()
        self.running: Optional[_Job] = None
        self.running_end = 0.0
        self.queued_s = 0.0

    def queue_seconds(self, now: float) -> float:
        busy = max(0.0, self.running_end - now) if self.running else 0.0
        return busy + self.queued_s


class _Decode:
    def __init__(self, iid: str, capacity: int, max_batch: Optional[int]) -> None:
        self.iid = iid
        self.capacity = capacity
        self.max_batch = max_batch
        self.reserved = 0
        self.batch = DecodeBatch()
        self.pending: list[tuple[TraceRequest, float]] = []
        self.stepping = False
        self.running: dict[int, DecodeSlot] = {}
        self.incoming: dict[int, DecodeSlot] = {}

    def fits(self, tokens: int) -> bool:
        if self.max_batch is not None and len(self.running) >= self.max_batch:
            return False
        return self.reserved + tokens <= self.capacity

    def state(self) -> DecodeInstanceState:
        """What the conductor sees, as the live one does: the batch and the KV of requests
        running here plus those already assigned here and still in prefill (a live decode
        worker reserves their blocks at assignment); for prediction, the slot lists."""
        incoming = list(self.incoming.values())
        assigned_tokens = sum(slot.tokens for slot in incoming)
        used = self.reserved + assigned_tokens
        return DecodeInstanceState(
            self.iid, self.batch.size + len(self.pending) + len(incoming), used,
            max(self.capacity - used, 0) // TRACE_BLOCK_TOKENS, TRACE_BLOCK_TOKENS,
            running=list(self.running.values()), incoming=incoming, max_batch=self.max_batch,
        )


class DisaggregatedSim:
    def __init__(self, trace: Sequence[TraceRequest], cost: CostModel, scheduler: str,
                 sched_cfg: SchedulerConfig, cluster: ClusterConfig,
                 decode_time: str = "empirical") -> None:
        if decode_time not in DECODE_TIME_MODES:
            raise ValueError(f"decode_time must be one of {DECODE_TIME_MODES}")
        self.decode_time = decode_time
        if sched_cfg.block_size != TRACE_BLOCK_TOKENS:
            raise ValueError("the simulator schedules 512-token trace blocks")
        self.trace, self.cost, self.cluster = trace, cost, cluster
        survival = "uniform" if decode_time == "mean" else sched_cfg.decode_survival
        self.sched_cfg = dataclasses.replace(sched_cfg, decode_survival=survival)
        self.scheduler = make_scheduler(scheduler, self.sched_cfg, cost)
        self.name = f"disagg/{scheduler}/{sched_cfg.admission}"
        cache_blocks = cluster.prefill_cache_tokens // TRACE_BLOCK_TOKENS
        pool_tokens = cluster.global_pool_tokens
        if pool_tokens is None:
            pool_tokens = cluster.num_prefill * cluster.prefill_cache_tokens
        self.pool = LRUBlockCache(pool_tokens // TRACE_BLOCK_TOKENS)
        self.prefill = [_Prefill(f"P{i}", cache_blocks) for i in range(cluster.num_prefill)]
        capacity = cluster.decode_capacity_tokens or cost.kv_capacity_tokens
        self.decode = [_Decode(f"D{i}", capacity, cluster.decode_max_batch)
                       for i in range(cluster.num_decode)]
        self._by_id = {d.iid: d for d in self.decode}
        self._pidx = {p.iid: p for p in self.prefill}
        self.records = [RequestRecord(r.index, r.arrival_s) for r in trace]
        self.result = SimResult(self.name, self.records)
        self._events: list = []
        self._seq = 0

    def _push(self, t: float, kind: int, a: object, b: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, a, b))

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        for r in self.trace:
            self._push(r.arrival_s, _ARRIVAL, r)
        handlers = {_ARRIVAL: self._on_arrival, _PREFILL_DONE: self._on_prefill_done,
                    _STEP_END: self._on_step_end}
        while self._events:
            t, _, kind, a, b = heapq.heappop(self._events)
            handlers[kind](t, a, b)
        self.result.sim_seconds = time.perf_counter() - t0
        return self.result

    # --- prefill side -------------------------------------------------------------------
    def _on_arrival(self, now: float, req: TraceRequest, _: object) -> None:
        info = RequestInfo(str(req.index), req.hash_ids, req.input_length,
                           req.input_length + req.output_length)  # KV counted in tokens here
        states = [PrefillInstanceState(p.iid, p.queue_seconds(now), p.cache, len(p.queue))
                  for p in self.prefill]
        decision = self.scheduler.schedule(info, states, [d.state() for d in self.decode],
                                           self.pool.prefix_len(req.hash_ids), now)
        rec = self.records[req.index]
        if not decision.accepted:
            why = decision.rejection
            rec.status, rec.reason = REJECTED_ARRIVAL, why.reason if why else None
            return
        p = self._pidx[decision.prefill_id]
        cached = decision.prefix_blocks_local + decision.prefix_blocks_to_fetch
        predicted = (self.scheduler.transfer_seconds(decision.prefix_blocks_to_fetch)
                     + self.scheduler.prefill_seconds(info, cached))
        if req.output_length > 1:
            d = self._by_id[decision.decode_id]
            d.incoming[req.index] = DecodeSlot(now + decision.predicted_ttft_s, _need(req),
                                               self._decode_s(req, decision.predicted_tbt_s))
        p.queue.append(_Job(req, info, decision, predicted))
        p.queued_s += predicted
        if p.running is None:
            self._start_prefill(p, now)

    def _start_prefill(self, p: _Prefill, now: float) -> None:
        job = p.queue.popleft()
        p.queued_s = max(0.0, p.queued_s - job.predicted_s) if p.queue else 0.0
        keys = job.req.hash_ids
        local = p.cache.prefix_len(keys)
        target = job.decision.prefix_blocks_local + job.decision.prefix_blocks_to_fetch
        fetched = max(0, target - local) if job.decision.prefix_blocks_to_fetch else 0
        self.result.hits.add(len(keys), local, fetched)
        duration = (self.scheduler.transfer_seconds(fetched)
                    + self.scheduler.prefill_seconds(job.info, local + fetched))
        p.running, p.running_end = job, now + duration
        self._push(p.running_end, _PREFILL_DONE, p)

    def _on_prefill_done(self, now: float, p: _Prefill, _: object) -> None:
        job = p.running
        assert job is not None
        p.running = None
        keys = job.req.hash_ids
        p.cache.touch(keys)       # computed and fetched blocks stay: hot prefixes replicate
        self.pool.touch(keys)     # new blocks are put into the store
        if p.queue:
            self._start_prefill(p, now)
        self._hand_to_decode(job, now)

    # --- decode side --------------------------------------------------------------------
    def _hand_to_decode(self, job: _Job, now: float) -> None:
        req, rec = job.req, self.records[job.req.index]
        rec.ttft_s = now - req.arrival_s
        if req.output_length <= 1:
            rec.status, rec.tbt_s, rec.finish_s = COMPLETED, 0.0, now
            return
        chosen = self._by_id[job.decision.decode_id]
        chosen.incoming.pop(req.index, None)
        need = _need(req)
        if not self._takes(chosen, req, need):
            if self.cluster.decode_handoff == "assigned":
                rec.status = REJECTED_AFTER_PREFILL
                rec.reason = "decode_full" if not chosen.fits(need) else "tbt_slo"
                return
            fitting = [d for d in self.decode if d.fits(need)]
            if not fitting:
                rec.status, rec.reason = REJECTED_AFTER_PREFILL, "decode_full"
                return
            chosen = min(fitting, key=lambda d: (self._tbt_with(d, req), d.iid))
            if not self._takes(chosen, req, need):
                rec.status, rec.reason = REJECTED_AFTER_PREFILL, "tbt_slo"
                return
        chosen.reserved += need
        chosen.running[req.index] = DecodeSlot(now, need, self._decode_s(req, None))
        chosen.pending.append((req, now))
        if not chosen.stepping:
            self._start_step(chosen, now)

    def _tbt_with(self, d: _Decode, req: TraceRequest) -> float:
        return self.cost.decode_tbt_seconds(len(d.running) + 1, d.reserved + req.input_length)

    def _takes(self, d: _Decode, req: TraceRequest, need: int) -> bool:
        """The decode instance's own check at hand-over: room, and the TBT SLO kept."""
        if not d.fits(need):
            return False
        slo = self.sched_cfg.tbt_slo_s
        return slo is None or self._tbt_with(d, req) <= slo

    def _decode_s(self, req: TraceRequest, tbt_s: Optional[float]) -> Optional[float]:
        """Predicted decode duration: None (the learned typical one) or, with the "oracle"
        mode, the trace's output length x TBT (output length is not known in practice)."""
        if self.decode_time != "oracle":
            return None
        if tbt_s is None or math.isinf(tbt_s):
            tbt_s = self.cost.decode_tbt_seconds(1, req.input_length)
        return (req.output_length - 1) * tbt_s

    def _start_step(self, d: _Decode, now: float) -> None:
        for req, ready in d.pending:
            d.batch.join(req.index, req.input_length, req.output_length - 1, ready)
        d.pending.clear()
        if d.batch.size == 0:
            d.stepping = False
            return
        d.stepping = True
        self._push(now + self.cost.decode_tbt_seconds(d.batch.size, d.batch.context_tokens),
                   _STEP_END, d)

    def _on_step_end(self, now: float, d: _Decode, _: object) -> None:
        for rid, tbt in d.batch.end_step(now):
            rec = self.records[rid]
            rec.status, rec.tbt_s, rec.finish_s = COMPLETED, tbt, now
            slot = d.running.pop(rid)
            d.reserved -= slot.tokens
            if self.decode_time in ("empirical", "mean"):
                # The conductor's history of decode durations, as the live one keeps it.
                self.scheduler.observe_decode(now - slot.start_s)
        self._start_step(d, now)


def _need(req: TraceRequest) -> int:
    return req.input_length + req.output_length


def simulate_disaggregated(trace: Sequence[TraceRequest], cost: CostModel, scheduler: str,
                           sched_cfg: SchedulerConfig, cluster: ClusterConfig,
                           decode_time: str = "empirical") -> SimResult:
    """Replay ``trace``.

    ``decode_time`` is how prediction-based admission predicts when a request leaves
    decode: "empirical" (default) = the survival function of the decode durations completed
    so far (``common.scheduling.decode_time``); "mean" = the paper's single typical decode
    time, the mean of those durations; "fixed" = ``sched_cfg.expected_decode_s``
    throughout; "oracle" = the request's true output length x predicted TBT (an oracle a
    real conductor does not have). Before 32 decodes have completed, "empirical" and
    "mean" use ``sched_cfg.expected_decode_s``.
    """
    return DisaggregatedSim(trace, cost, scheduler, sched_cfg, cluster, decode_time).run()
