"""Decode-side choice and load prediction (plain and prediction-based early rejection).

A decode instance *holds* a request when its KV (prompt + max_tokens) fits in free memory
and, if it has a fixed maximum batch, the batch has a free seat; its predicted TBT is the cost model's step time with the request added. Prediction-based
early rejection looks at the decode load at the moment the request's prefill will end:
requests predicted to finish prefill by then join (``incoming``), and every request leaves
once it has decoded for the typical decode time ``expected_decode_s`` (``running`` ones
and ``incoming`` ones alike), or after its own ``DecodeSlot.decode_s`` when known.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from common.scheduling.cost import CostModel
from common.scheduling.state import DecodeInstanceState, DecodeSlot, RequestInfo


@dataclass(frozen=True)
class DecodeLoad:
    batch_size: int
    context_tokens: int
    capacity_tokens: int
    max_batch: Optional[int] = None   # None: only KV memory bounds the batch

    def fits(self, tokens: int) -> bool:
        if self.max_batch is not None and self.batch_size + 1 > self.max_batch:
            return False
        return self.context_tokens + tokens <= self.capacity_tokens


def current_load(state: DecodeInstanceState) -> DecodeLoad:
    return DecodeLoad(state.batch_size, state.total_context_tokens, state.capacity_tokens,
                      state.max_batch)


def predicted_load(state: DecodeInstanceState, at_s: float, expected_decode_s: float) -> DecodeLoad:
    """Decode load of ``state`` at time ``at_s`` (falls back to now without slot lists)."""
    if not state.running and not state.incoming:
        return current_load(state)
    batch, tokens = 0, 0
    for slot in state.running:
        if slot.start_s + _duration(slot, expected_decode_s) > at_s:
            batch += 1
            tokens += slot.tokens
    for slot in state.incoming:
        if slot.start_s <= at_s < slot.start_s + _duration(slot, expected_decode_s):
            batch += 1
            tokens += slot.tokens
    return DecodeLoad(batch, tokens, state.capacity_tokens, state.max_batch)


def _duration(slot: DecodeSlot, expected_decode_s: float) -> float:
    return expected_decode_s if slot.decode_s is None else slot.decode_s


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
    need = req.prompt_tokens + req.max_tokens
    ranked = []
    for i, load in enumerate(loads):
        fits = load.fits(need)
        if require_fit and not fits:
            continue
        tbt = cost.decode_tbt_seconds(load.batch_size + 1, load.context_tokens + req.prompt_tokens)
        ranked.append((not fits, tbt, i))
    if not ranked:
        return DecodeChoice(None, math.inf)
    _, tbt, index = min(ranked)
    return DecodeChoice(index, tbt)
