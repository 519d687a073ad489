"""Decode-side choice and load prediction (plain and prediction-based early rejection).

A decode instance *holds* a request when its KV (``RequestInfo.kv_tokens``) fits in free
memory and, if it has a fixed maximum batch, the batch has a free seat; its predicted TBT is the
cost model's time between two tokens with the request added, in turns of at most
``step_batch`` sequences per step when the instance has such a limit (the worker serves a
larger batch in turns; see ``CostModel.decode_tbt_seconds``). Prediction-based early
rejection looks at the decode load at the moment ``at_s`` the request's prefill will end:
each request running on the instance, and each one predicted to finish prefill by then
(``incoming``), counts with the probability that it is still decoding at ``at_s``
(``DecodeDurations``: the empirical survival of recent decode durations, or the paper's
uniform typical time), or exactly when its own ``DecodeSlot.decode_s`` is known. Batch
size and context are thus expected values. Batch sizes count sequences: a request of n
choices decodes as n sequences, each attending to its prompt (``RequestInfo.sequences``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from common.scheduling.cost import CostModel
from common.scheduling.decode_time import DecodeDurations
from common.scheduling.state import DecodeInstanceState, DecodeSlot, RequestInfo


@dataclass(frozen=True)
class DecodeLoad:
    batch_size: float        # an expected value when predicted
    context_tokens: float
    capacity_tokens: int
    max_batch: Optional[int] = None   # None: only KV memory bounds the batch
    step_batch: Optional[int] = None  # most sequences per step; beyond it, turns

    def fits(self, tokens: int, sequences: int = 1) -> bool:
        if self.max_batch is not None and self.batch_size + sequences > self.max_batch:
            return False
        return self.context_tokens + tokens <= self.capacity_tokens


def current_load(state: DecodeInstanceState) -> DecodeLoad:
    return DecodeLoad(state.batch_size, state.total_context_tokens, state.capacity_tokens,
                      state.max_batch, state.step_batch)


def predicted_load(state: DecodeInstanceState, at_s: float, now_s: float,
                   durations: DecodeDurations) -> DecodeLoad:
    """Expected decode load of ``state`` at ``at_s`` (falls back to now without slot lists)."""
    if not state.running and not state.incoming:
        return current_load(state)
    batch, tokens = 0.0, 0.0
    for slot in state.running:
        p = _alive(slot, at_s, max(now_s - slot.start_s, 0.0), at_s - now_s, durations)
        batch += p * slot.sequences
        tokens += p * slot.tokens
    for slot in state.incoming:
        if slot.start_s <= at_s:
            p = _alive(slot, at_s, 0.0, at_s - slot.start_s, durations)
            batch += p * slot.sequences
            tokens += p * slot.tokens
    return DecodeLoad(batch, tokens, state.capacity_tokens, state.max_batch, state.step_batch)


def _alive(slot: DecodeSlot, at_s: float, elapsed_s: float, horizon_s: float,
           durations: DecodeDurations) -> float:
    if slot.decode_s is not None:
        return 1.0 if at_s < slot.start_s + slot.decode_s else 0.0
    return durations.still_running(elapsed_s, horizon_s)


@dataclass(frozen=True)
class DecodeChoice:
    index: Optional[int]      # None: no instance can hold the request
    tbt_s: float              # predicted TBT on the chosen instance (inf if none)


def choose_decode(
    req: RequestInfo,
    loads: Sequence[DecodeLoad],
    cost: CostModel,
    require_fit: bool,
) -> DecodeChoice:
    """Lowest predicted TBT among instances that hold the request (ties: lowest index).

    With ``require_fit=False`` an instance is chosen even if none has room (instances
    with room still come first).
    """
    need = req.kv_tokens
    n = req.sequences
    ranked = []
    for i, load in enumerate(loads):
        fits = load.fits(need, n)
        if require_fit and not fits:
            continue
        tbt = cost.decode_tbt_seconds(load.batch_size + n,
                                      load.context_tokens + n * req.prompt_tokens,
                                      load.step_batch)
        ranked.append((not fits, tbt, i))
    if not ranked:
        return DecodeChoice(None, math.inf)
    _, tbt, index = min(ranked)
    return DecodeChoice(index, tbt)
