"""Shared builders for the scheduling tests (1 ms/token prefill, 10 ms per fetched block)."""
from __future__ import annotations

from common.scheduling import (
    CostModel,
    DecodeCoefficients,
    DecodeInstanceState,
    PrefillCoefficients,
    PrefillInstanceState,
    PrefixIndex,
)

BLOCK = 100


def cost() -> CostModel:
    return CostModel(
        prefill=PrefillCoefficients(c_new=0.001),
        decode=DecodeCoefficients(d0=0.01, d_batch=0.001, d_ctx=1e-6),
        kv_bytes_per_token=1000,
        transfer_bandwidth_bytes_per_s=1e7,
    )


def prefill(iid: str, queue: float, cached: int) -> PrefillInstanceState:
    return PrefillInstanceState(iid, queue, PrefixIndex(range(cached)))


def decode(iid: str, batch: int = 0, ctx: int = 0, free_blocks: int = 1000) -> DecodeInstanceState:
    return DecodeInstanceState(iid, batch, ctx, free_blocks, BLOCK)
