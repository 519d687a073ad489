"""crescent_worker_kv_blocks: each worker's used and free KV blocks, from its heartbeats."""
from __future__ import annotations

from services.conductor.metrics import ConductorMetrics
from services.conductor.registry import Registry
from services.conductor.tracker import Tracker
from tests.conductor.test_conductor import beat, worker


def blocks(m: ConductorMetrics, instance: str, state: str) -> float | None:
    return m.registry.get_sample_value("crescent_worker_kv_blocks",
                                       {"instance": instance, "state": state})


def test_kv_blocks_follow_heartbeats_and_leave_with_the_worker() -> None:
    m, registry = ConductorMetrics(), Registry(heartbeat_timeout_s=5.0)
    for i, free in ((0, 90), (1, 70)):
        registry.register(worker("decode", i), now=1.0)
        registry.heartbeat(beat("decode", i, free=free), now=1.0)
    registry.register(worker("prefill", 0), now=1.0)  # no heartbeat yet: all blocks free
    m.update_gauges(registry, Tracker())
    assert [(blocks(m, "decode-0", s), blocks(m, "decode-1", s), blocks(m, "prefill-0", s))
            for s in ("used", "free")] == [(10, 30, 0), (90, 70, 100)]

    registry.heartbeat(beat("decode", 0, free=40), now=2.0)
    assert len(registry.expire(now=6.5)) == 2  # silent since 1.0: decode-1 and prefill-0
    m.update_gauges(registry, Tracker())
    assert (blocks(m, "decode-0", "used"), blocks(m, "decode-0", "free")) == (60, 40)
    assert blocks(m, "decode-1", "used") is None and blocks(m, "prefill-0", "free") is None
