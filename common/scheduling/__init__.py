"""Scheduling policy (pure Python: no zmq, no torch), shared by the conductor and the simulator."""
from __future__ import annotations

from common.scheduling.admission import DecodeLoad, choose_decode, current_load, predicted_load
from common.scheduling.cost import (
    CostModel,
    DecodeCoefficients,
    PipelineCost,
    PrefillCoefficients,
    fit_prefill_cost,
)
from common.scheduling.policies import (
    SCHEDULERS,
    KVCacheCentricScheduler,
    LoadBalanceScheduler,
    LocalCacheAwareScheduler,
    PrefillChoice,
    RandomScheduler,
    RoundRobinScheduler,
    Scheduler,
    make_scheduler,
)
from common.scheduling.state import (
    ADMISSION_MODES,
    DecodeInstanceState,
    DecodeSlot,
    LRUBlockCache,
    NO_INSTANCES,
    PrefillInstanceState,
    PrefixIndex,
    REJECT_REASONS,
    Rejection,
    RequestInfo,
    ScheduleDecision,
    SchedulerConfig,
)

__all__ = [
    "ADMISSION_MODES", "CostModel", "DecodeCoefficients", "DecodeInstanceState", "DecodeLoad",
    "DecodeSlot", "KVCacheCentricScheduler", "LRUBlockCache", "LoadBalanceScheduler",
    "LocalCacheAwareScheduler", "NO_INSTANCES", "PipelineCost", "PrefillChoice",
    "PrefillCoefficients", "PrefillInstanceState",
    "PrefixIndex", "REJECT_REASONS", "RandomScheduler", "Rejection", "RequestInfo",
    "RoundRobinScheduler", "SCHEDULERS", "ScheduleDecision", "Scheduler", "SchedulerConfig",
    "choose_decode", "current_load", "fit_prefill_cost", "make_scheduler", "predicted_load",
]
