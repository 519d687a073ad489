"""What the conductor predicts TTFT from: a prompt whose prefix a request queued ahead of
it on the same prefill worker computes is priced as cached there (the worker computes the
earlier one first), and only requests that had their prefill worker to themselves teach
the online calibration."""
from __future__ import annotations

from typing import Optional

import pytest

from common.config import ClusterConfig, SLOConfig
from common.kv.events import KVEvents
from common.protocol import (BlocksReserved, PrefillDone, PrefillTask, RegisterWorker,
                             SubmitRequest, WorkerHeartbeat, WorkerLoad)
from common.sampling_params import SamplingParams
from services.conductor.service import Conductor
from tests.conductor.test_ttft_log import Clock, Mail


def conductor(clock: Optional[Clock] = None) -> tuple[Conductor, Mail]:
    mail, clock = Mail(), clock or Clock()
    cfg = ClusterConfig(slo=SLOConfig(ttft_s=1000, tbt_s=1000), block_size=16,
                        cost_profile="cpu-smollm2-135m")
    c = Conductor(cfg, mail, clock=clock)  # type: ignore[arg-type]
    for role in ("prefill", "decode"):
        c.on_register(RegisterWorker(f"{role}-0", role, f"tcp://w/{role}", "h:0", 4096, 1024,
                                     32, 1000, 16))
        c.on_heartbeat(WorkerHeartbeat(f"{role}-0", role, WorkerLoad(), 1000, 0, 1000, KVEvents(), 0))
    return c, mail


def submit(c: Conductor, rid: str, blocks: int, tail: int) -> None:
    keys = [f"k{i}" for i in range(blocks)]
    c.on_submit(SubmitRequest(rid, list(range(blocks * 16 + tail)), keys,
                              SamplingParams(max_tokens=8), 0.0))


def test_a_queued_prompts_prefix_counts_as_cached_for_the_next() -> None:
    c, mail = conductor()
    submit(c, "first", blocks=40, tail=5)
    submit(c, "turn2", blocks=40, tail=9)  # the same 40 blocks, a longer tail
    first, turn2 = (c.tracker.get(r) for r in ("first", "turn2"))
    assert first.prefill_tokens == 40 * 16 + 5
    assert turn2.prefill_tokens == 9
    alone = c.placer.cost.prefill_seconds(645, 0)
    # turn2 waits for the first, then computes its tail only
    assert turn2.predicted_ttft_s < alone + c.placer.cost.prefill_seconds(9, 640) + 1e-9
    assert turn2.predicted_ttft_s > alone


def test_a_prompt_behind_a_queued_prefix_waits_for_that_prompt_not_the_queue() -> None:
    """Shortest first, a long prompt queued after the one computing turn2's prefix does not
    delay turn2: it waits until that one is predicted done (its TTFT), then its tail."""
    c, _ = conductor()
    submit(c, "first", blocks=40, tail=5)
    c.on_submit(SubmitRequest("long", list(range(1000, 1000 + 50 * 16)),
                              [f"x{i}" for i in range(50)], SamplingParams(max_tokens=8), 0.0))
    submit(c, "turn2", blocks=40, tail=9)
    first, long, turn2 = (c.tracker.get(r) for r in ("first", "long", "turn2"))
    tail = c.placer.cost.prefill_seconds(9, 640)
    assert turn2.predicted_ttft_s == pytest.approx(first.predicted_ttft_s + tail)
    assert turn2.predicted_ttft_s < long.predicted_ttft_s


def test_done_prompts_no_longer_count_unless_the_worker_reports_them() -> None:
    c, _ = conductor()
    submit(c, "first", blocks=10, tail=5)
    c.registry.release_prefill(c.tracker.get("first"))
    c.tracker.pop("first")
    submit(c, "later", blocks=10, tail=5)  # no KV event said the worker kept the blocks
    assert c.tracker.get("later").prefill_tokens == 10 * 16 + 5


def done(c: Conductor, mail: Mail, rid: str, cached: int = 0) -> None:
    """Its blocks reserved, then its KV landed (PrefillDone)."""
    c.on_reserved(BlocksReserved(rid, "decode-0", [1, 2]))
    [task] = [m for m in mail.sent if isinstance(m, PrefillTask) and m.request_id == rid]
    t = c.tracker.get(rid)
    c.on_prefill_done(PrefillDone(rid, "prefill-0", len(t.req.token_ids), cached, 0, 0.1, 0,
                                  fence=task.fence))


def test_only_requests_alone_on_their_prefill_worker_are_calibration_samples() -> None:
    clock = Clock()
    c, mail = conductor(clock)
    submit(c, "alone", blocks=2, tail=3)
    clock.t += 0.4
    done(c, mail, "alone", cached=16)
    cal = c.placer.calibrator
    assert [s for *_, s in cal.alone] == [pytest.approx(0.4)] and len(cal.computed) == 1
    assert cal.alone[0][:2] == (35 - 16, cal.cost.profile_prefill_seconds(35 - 16, 16))
    submit(c, "a", blocks=1, tail=1)
    submit(c, "b", blocks=3, tail=1)  # queued behind a: neither TTFT is its own
    assert not c.tracker.get("a").alone and not c.tracker.get("b").alone
    clock.t += 1.0
    done(c, mail, "a")
    done(c, mail, "b")
    submit(c, "c", blocks=1, tail=2)  # a and b are decoding: c is alone again
    assert c.tracker.get("c").alone
    assert len(cal.alone) == 1 and len(cal.computed) == 3
