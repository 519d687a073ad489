"""Schedulers: Mooncake's KVCache-centric Algorithm 1 and its baselines, one code path.

Every policy only decides *which prefill instance* (and how much prefix to fetch); the
decode choice (lowest predicted TBT) and SLO admission are shared, so baselines differ
from Algorithm 1 in exactly one place. Select by name with ``make_scheduler``.
"""
from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence

from common.scheduling.admission import (
    choose_decode,
    current_load,
    predicted_load,
)
from common.scheduling.cost import CostModel
from common.scheduling.decode_time import DecodeDurations
from common.scheduling.state import (
    NO_INSTANCES,
    DecodeInstanceState,
    PrefillInstanceState,
    Rejection,
    RequestInfo,
    ScheduleDecision,
    SchedulerConfig,
)


@dataclass(frozen=True)
class PrefillChoice:
    index: int
    local_blocks: int   # leading blocks reused from the instance's own cache
    fetch_blocks: int   # further leading blocks pulled from the pool / another instance
    ttft_s: float       # T_queue + T_transfer + T_prefill


class Scheduler(ABC):
    """Places a request on a prefill and a decode instance, or rejects it before any work.

    ``schedule`` is the whole contract; subclasses implement ``choose_prefill`` only.
    """

    name: ClassVar[str] = ""

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        self.config = config
        self.cost = cost
        kv_bytes = config.kv_bytes_per_token or cost.kv_bytes_per_token
        bandwidth = config.transfer_bandwidth_bytes_per_s or cost.transfer_bandwidth_bytes_per_s
        self._block_bytes = kv_bytes * config.block_size
        self._bandwidth = bandwidth
        self.decode_durations = DecodeDurations(
            config.expected_decode_s, uniform=config.decode_survival == "uniform")

    def observe_decode(self, seconds: float) -> None:
        """A decode finished after ``seconds``: history for prediction-based admission."""
        self.decode_durations.observe(seconds)

    def set_transfer_bandwidth(self, bytes_per_s: float) -> None:
        """Price a prefix fetch at ``bytes_per_s`` from now on (learned from real loads)."""
        if not bytes_per_s > 0:
            raise ValueError(f"transfer bandwidth must be positive, got {bytes_per_s}")
        self._bandwidth = bytes_per_s

    # --- the cost of running a request on one prefill instance ----------------------
    def transfer_seconds(self, blocks: int) -> float:
        return blocks * self._block_bytes / self._bandwidth if blocks > 0 else 0.0

    def new_tokens(self, req: RequestInfo, cached_blocks: int) -> int:
        """The tokens ``req`` computes after ``cached_blocks`` of its prompt."""
        return max(req.prompt_tokens - cached_blocks * self.config.block_size, 1)

    def prefill_seconds(self, req: RequestInfo, cached_blocks: int,
                        cost: Optional[CostModel] = None) -> float:
        """On an instance whose own cost model is ``cost`` (None: the scheduler's)."""
        new = self.new_tokens(req, cached_blocks)
        return (cost or self.cost).prefill_seconds(new, req.prompt_tokens - new)

    def estimate(self, req: RequestInfo, p: PrefillInstanceState, index: int,
                 local: int, fetch: int) -> PrefillChoice:
        behind = p.prefix_index.queued_within(req.block_keys[:local])
        own = self.prefill_seconds(req, local + fetch, p.cost)
        ttft = (p.wait_s(self.new_tokens(req, local + fetch), behind, own)
                + self.transfer_seconds(fetch) + own)
        return PrefillChoice(index, local, fetch, ttft)

    # --- the contract ---------------------------------------------------------------
    @abstractmethod
    def choose_prefill(self, req: RequestInfo, prefill: Sequence[PrefillInstanceState],
                       local: Sequence[int], best_len: int) -> PrefillChoice:
        """Pick a prefill instance; ``local[i]`` = prefix blocks cached on instance i."""

    def schedule(self, req: RequestInfo, prefill: Sequence[PrefillInstanceState],
                 decode: Sequence[DecodeInstanceState], global_prefix_len: int,
                 now: float) -> ScheduleDecision:
        if not prefill or not decode:
            return _reject(Rejection(NO_INSTANCES, 1.0, "no prefill or decode instance"),
                           math.inf, math.inf)
        local = [p.prefix_index.prefix_len(req.block_keys) for p in prefill]
        best_len = max(global_prefix_len, max(local))
        choice = self.choose_prefill(req, prefill, local, best_len)
        return self._admit(req, prefill[choice.index], decode, choice, now)

    def _decode_retry(self) -> float:
        return max(1.0, self.decode_durations.mean() / 2)

    def _admit(self, req: RequestInfo, p: PrefillInstanceState,
               decode: Sequence[DecodeInstanceState], choice: PrefillChoice,
               now: float) -> ScheduleDecision:
        cfg = self.config
        if cfg.admission == "predicted":
            at = now + choice.ttft_s
            loads = [predicted_load(d, at, now, self.decode_durations) for d in decode]
        else:
            loads = [current_load(d) for d in decode]
        checks_decode = cfg.admission != "none"
        dchoice = choose_decode(req, loads, self.cost, require_fit=checks_decode)
        ttft, tbt = choice.ttft_s, dchoice.tbt_s
        if cfg.ttft_slo_s is not None and ttft > cfg.ttft_slo_s:
            return _reject(Rejection(
                "ttft_slo", max(1.0, ttft - cfg.ttft_slo_s),
                f"predicted TTFT {ttft:.2f} s exceeds the {cfg.ttft_slo_s:g} s SLO"), ttft, tbt)
        if checks_decode and dchoice.index is None:
            return _reject(Rejection("decode_full", self._decode_retry(),
                                     f"no decode instance has room for {req.kv_tokens} "
                                     "tokens (prompt + max_tokens)"),
                           ttft, tbt)
        if checks_decode and cfg.tbt_slo_s is not None and tbt > cfg.tbt_slo_s:
            return _reject(Rejection(
                "tbt_slo", self._decode_retry(), f"predicted TBT {tbt * 1000:.0f} ms exceeds "
                f"the {cfg.tbt_slo_s * 1000:g} ms SLO"), ttft, tbt)
        assert dchoice.index is not None
        return ScheduleDecision(
            accepted=True, prefill_id=p.instance_id, decode_id=decode[dchoice.index].instance_id,
            prefix_blocks_local=choice.local_blocks, prefix_blocks_to_fetch=choice.fetch_blocks,
            predicted_ttft_s=ttft, predicted_tbt_s=tbt,
        )


def _reject(rejection: Rejection, ttft: float, tbt: float) -> ScheduleDecision:
    return ScheduleDecision(
        accepted=False, prefill_id=None, decode_id=None, prefix_blocks_local=0,
        prefix_blocks_to_fetch=0, predicted_ttft_s=ttft, predicted_tbt_s=tbt,
        rejection=rejection,
    )


class RandomScheduler(Scheduler):
    name = "random"

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self._rng = random.Random(config.seed)

    def choose_prefill(self, req, prefill, local, best_len):  # type: ignore[override]
        i = self._rng.randrange(len(prefill))
        return self.estimate(req, prefill[i], i, local[i], 0)


class RoundRobinScheduler(Scheduler):
    name = "round_robin"

    def __init__(self, config: SchedulerConfig, cost: CostModel) -> None:
        super().__init__(config, cost)
        self._next = 0

    def choose_prefill(self, req, prefill, local, best_len):  # type: ignore[override]
        i = self._next % len(prefill)
        self._next = i + 1
        return self.estimate(req, prefill[i], i, local[i], 0)


class LoadBalanceScheduler(Scheduler):
    """Least predicted queue time (ties: first instance)."""

    name = "load_balance"

    def choose_prefill(self, req, prefill, local, best_len):  # type: ignore[override]
        i = min(range(len(prefill)), key=lambda j: (prefill[j].queue_seconds, j))
        return self.estimate(req, prefill[i], i, local[i], 0)


class LocalCacheAwareScheduler(Scheduler):
    """Least TTFT using each instance's own cached prefix only (never fetches)."""

    name = "local_cache_aware"

    def choose_prefill(self, req, prefill, local, best_len):  # type: ignore[override]
        options = [self.estimate(req, p, i, local[i], 0) for i, p in enumerate(prefill)]
        return min(options, key=lambda c: (c.ttft_s, c.index))


class KVCacheCentricScheduler(Scheduler):
    """Paper Algorithm 1: least TTFT, fetching the best prefix when worth it.

    Instance p fetches the ``best_len - prefix_len(p)`` missing blocks when
    ``best_len / prefix_len(p) > kvcache_balancing_threshold`` (``prefix_len(p) == 0``
    counts as an infinite ratio when ``best_len > 0``); the fetched blocks stay on p.
    """

    name = "kvcache_centric"

    def choose_prefill(self, req, prefill, local, best_len):  # type: ignore[override]
        threshold = self.config.kvcache_balancing_threshold
        options = []
        for i, p in enumerate(prefill):
            fetch = 0
            if best_len > local[i] and best_len > threshold * local[i]:
                fetch = best_len - local[i]
            options.append(self.estimate(req, p, i, local[i], fetch))
        return min(options, key=lambda c: (c.ttft_s, c.index))


SCHEDULERS: dict[str, Callable[[SchedulerConfig, CostModel], Scheduler]] = {
    cls.name: cls
    for cls in (RandomScheduler, RoundRobinScheduler, LoadBalanceScheduler,
                LocalCacheAwareScheduler, KVCacheCentricScheduler)
}


def make_scheduler(name: str, config: SchedulerConfig, cost: CostModel) -> Scheduler:
    try:
        factory = SCHEDULERS[name]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; known: {sorted(SCHEDULERS)}") from None
    return factory(config, cost)


__all__ = [
    "PrefillChoice", "Scheduler", "SCHEDULERS", "make_scheduler",
    "RandomScheduler", "RoundRobinScheduler", "LoadBalanceScheduler",
    "LocalCacheAwareScheduler", "KVCacheCentricScheduler",
]
