"""Colocated (vLLM-like) baseline: every instance prefills and decodes.

Each instance has a local prefix cache (LRU, 512-token blocks), a FIFO waiting queue, and
one continuous batch. A step gives each running request one token and fills the rest of
a ``chunk_tokens`` budget with prefill chunks from the queue (chunked prefill, decode
first). Step time = decode TBT of the batch (or the prefill fixed cost with no batch)
plus the prefill polynomial of each chunk without its fixed term, so a chunk riding along
slows every running request: the interference disaggregation removes. Requests are
routed by a ``common.scheduling`` policy on the instances' predicted prefill backlog and
local prefixes (no global pool, no fetching).
"""
from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

from common.scheduling import (
    CostModel,
    DecodeInstanceState,
    LRUBlockCache,
    PrefillInstanceState,
    RequestInfo,
    SchedulerConfig,
    make_scheduler,
)
from traces.batch import DecodeBatch
from traces.loader import TRACE_BLOCK_TOKENS, TraceRequest
from traces.metrics import COMPLETED, REJECTED_ARRIVAL, RequestRecord, SimResult


@dataclass
class ColocatedConfig:
    num_instances: int = 16
    chunk_tokens: int = 2048
    kv_capacity_tokens: Optional[int] = None   # None: the cost model's
    cache_tokens: Optional[int] = None         # prefix cache; None: kv_capacity_tokens


@dataclass
class _Waiting:
    req: TraceRequest
    predicted_s: float
    done_tokens: int = 0        # cached + computed so far
    started: bool = False


class _Instance:
    def __init__(self, iid: str, capacity: int, cache_blocks: int) -> None:
        self.iid = iid
        self.capacity = capacity
        self.reserved = 0
        self.cache = LRUBlockCache(cache_blocks)
        self.waiting: deque[_Waiting] = deque()
        self.backlog_s = 0.0
        self.batch = DecodeBatch()
        self.stepping = False
        self.in_step: list[_Waiting] = []
        self.need: dict[int, int] = {}


class ColocatedSim:
    def __init__(self, trace: Sequence[TraceRequest], cost: CostModel, scheduler: str,
                 sched_cfg: SchedulerConfig, cfg: ColocatedConfig) -> None:
        self.trace, self.cost, self.cfg = trace, cost, cfg
        self.scheduler = make_scheduler(scheduler, sched_cfg, cost)
        capacity = cfg.kv_capacity_tokens or cost.kv_capacity_tokens
        cache_blocks = (cfg.cache_tokens or capacity) // TRACE_BLOCK_TOKENS
        self.instances = [_Instance(f"C{i}", capacity, cache_blocks) for i in range(cfg.num_instances)]
        self._pidx = {x.iid: x for x in self.instances}
        self.records = [RequestRecord(r.index, r.arrival_s) for r in trace]
        self.result = SimResult(f"colocated/{scheduler}/chunk{cfg.chunk_tokens}", self.records)
        self._events: list = []
        self._seq = 0

    def _push(self, t: float, kind: int, obj: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, obj))

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        for r in self.trace:
            self._push(r.arrival_s, 0, r)
        while self._events:
            t, _, kind, obj = heapq.heappop(self._events)
            if kind == 0:
                self._on_arrival(t, obj)
            else:
                self._on_step_end(t, obj)
        self.result.sim_seconds = time.perf_counter() - t0
        return self.result

    def _on_arrival(self, now: float, req: TraceRequest) -> None:
        info = RequestInfo(str(req.index), req.hash_ids, req.input_length,
                           req.input_length + req.output_length)  # KV counted in tokens here
        states = [PrefillInstanceState(x.iid, x.backlog_s, x.cache, len(x.waiting))
                  for x in self.instances]
        dummy = [DecodeInstanceState("colocated", 0, 0, 1 << 40, TRACE_BLOCK_TOKENS)]
        decision = self.scheduler.schedule(info, states, dummy, 0, now)
        if not decision.accepted or decision.prefill_id is None:
            rec = self.records[req.index]
            why = decision.rejection
            rec.status, rec.reason = REJECTED_ARRIVAL, why.reason if why else None
            return
        inst = self._pidx[decision.prefill_id]
        predicted = self.scheduler.prefill_seconds(info, decision.prefix_blocks_local)
        inst.waiting.append(_Waiting(req, predicted))
        inst.backlog_s += predicted
        if not inst.stepping:
            self._start_step(inst, now)

    def _take_prefill(self, inst: _Instance, budget: int) -> float:
        """Move chunks of waiting prompts into this step; returns their compute seconds."""
        seconds, c0 = 0.0, self.cost.prefill.c0
        for w in inst.waiting:
            if budget <= 0:
                break
            if not w.started:
                need = w.req.input_length + w.req.output_length
                if inst.reserved + need > inst.capacity:
                    break                       # FCFS: wait for memory
                inst.reserved += need
                inst.need[w.req.index] = need
                local = inst.cache.prefix_len(w.req.hash_ids)
                w.done_tokens = min(local * TRACE_BLOCK_TOKENS, w.req.input_length - 1)
                w.started = True
                self.result.hits.add(len(w.req.hash_ids), local, 0)
            take = min(budget, w.req.input_length - w.done_tokens)
            seconds += self.cost.prefill_seconds(take, w.done_tokens) - c0
            w.done_tokens += take
            budget -= take
            inst.in_step.append(w)
        return seconds

    def _start_step(self, inst: _Instance, now: float) -> None:
        budget = self.cfg.chunk_tokens - inst.batch.size
        prefill_s = self._take_prefill(inst, budget)
        if inst.batch.size == 0 and not inst.in_step:
            inst.stepping = False
            return
        if inst.batch.size:
            base = self.cost.decode_tbt_seconds(inst.batch.size, inst.batch.context_tokens)
        else:
            base = self.cost.prefill.c0
        inst.stepping = True
        self._push(now + base + prefill_s, 1, inst)

    def _on_step_end(self, now: float, inst: _Instance) -> None:
        for rid, tbt in inst.batch.end_step(now):
            rec = self.records[rid]
            rec.status, rec.tbt_s, rec.finish_s = COMPLETED, tbt, now
            inst.reserved -= inst.need.pop(rid)
        for w in inst.in_step:
            if w.done_tokens >= w.req.input_length:
                self._finish_prefill(inst, w, now)
        inst.in_step.clear()
        self._start_step(inst, now)

    def _finish_prefill(self, inst: _Instance, w: _Waiting, now: float) -> None:
        req, rec = w.req, self.records[w.req.index]
        inst.waiting.remove(w)
        inst.backlog_s = max(0.0, inst.backlog_s - w.predicted_s)
        inst.cache.touch(req.hash_ids)
        rec.ttft_s = now - req.arrival_s
        if req.output_length <= 1:
            rec.status, rec.tbt_s, rec.finish_s = COMPLETED, 0.0, now
            inst.reserved -= inst.need.pop(req.index)
            return
        inst.batch.join(req.index, req.input_length, req.output_length - 1, now)


def simulate_colocated(trace: Sequence[TraceRequest], cost: CostModel, scheduler: str,
                       sched_cfg: SchedulerConfig, cfg: ColocatedConfig) -> SimResult:
    return ColocatedSim(trace, cost, scheduler, sched_cfg, cfg).run()
