"""The conductor knows the decode workers' live batch limit (``max_batch_size``): a batch
beyond it is served in turns, and the predicted TBT (hence admission) says so."""
from __future__ import annotations

import pytest

from common.config import ClusterConfig, SLOConfig
from common.kv.events import KVEvents
from common.protocol import RegisterWorker, SubmitRequest, WorkerHeartbeat, WorkerLoad
from common.sampling_params import SamplingParams
from common.scheduling import Rejection
from services.conductor.placement import Placement, Placer
from services.conductor.registry import Registry


def _registry(running: int, context: int) -> Registry:
    reg = Registry(heartbeat_timeout_s=60)
    for role in ("prefill", "decode"):
        reg.register(RegisterWorker(f"{role}-0", role, f"tcp://w/{role}", "h:0", 4096, 1024,
                                    32, 1000, 16))
    reg.heartbeat(WorkerHeartbeat("decode-0", "decode",
                                  WorkerLoad(running=running, context_tokens=context), 900, 100,
                                  1000, KVEvents(), 0))
    return reg


def _placer(max_batch_size: int) -> Placer:
    return Placer(ClusterConfig(max_batch_size=max_batch_size, admission="early",
                                slo=SLOConfig(ttft_s=1000.0, tbt_s=0.2)))


def _submit() -> SubmitRequest:
    return SubmitRequest("r1", list(range(40)), [], SamplingParams(max_tokens=8), 0.0)


def test_decode_state_carries_max_batch_size() -> None:
    placer = _placer(3)
    w = _registry(4, 100).get("decode-0")
    assert w is not None
    state = placer._decode_state(w, 0.0)
    assert (state.batch_size, state.step_batch, state.max_batch) == (4, 3, None)


def test_batch_over_the_limit_is_predicted_in_turns() -> None:
    reg = _registry(running=4, context=100)
    roomy = _placer(64).place(_submit(), reg, now=0.0)
    assert isinstance(roomy, Placement)
    # Five sequences (4 running + this one) in steps of 2: three turns per token.
    d = _placer(2).cost.decode
    tbt = 3 * d.d0 + 5 * d.d_batch + (100 + 40) * d.d_ctx
    assert tbt == pytest.approx(0.3143, abs=1e-4)  # cpu-smollm2-135m profile
    limited = _placer(2).place(_submit(), reg, now=0.0)
    # Retry after half the typical decode (expected_decode_s 10 s, nothing observed yet).
    assert limited == Rejection("tbt_slo", 5.0, "predicted TBT 314 ms exceeds the 200 ms SLO")
