"""A prefill pipeline group's own cost model: its TTFT prediction (short prompts gain
nothing from the stages, long ones approach 1/X), its online calibration from its own
prefills, and placement over a mixed pool (short prompts skip the pipeline)."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from common.config import ClusterConfig, SLOConfig
from common.protocol import PrefillDone, SubmitRequest
from common.sampling_params import SamplingParams
from common.scheduling import CostModel, PipelineCost
from common.scheduling.cost import DecodeCoefficients, PrefillCoefficients
from services.conductor.calibration import PrefillCalibrator
from services.conductor.service import Conductor
from tests.conductor.test_conductor import RecordingMail, beat, worker

WHOLE = CostModel(PrefillCoefficients(c0=0.01, c_new=0.002, c_new_sq=1e-7),
                  DecodeCoefficients(d0=0.02), 46080, 1e9)


def test_one_chunk_gains_nothing_and_a_long_prompt_tends_to_one_over_x() -> None:
    pipe = PipelineCost(WHOLE, stages=2, chunk=256, hop_s=0.001)
    assert pipe.prefill_seconds(200, 0) == pytest.approx(WHOLE.prefill_seconds(200, 0) + 0.002)
    n = 256 * 64  # 64 chunks: 65 slots of 1/128 of the whole prompt
    assert pipe.prefill_seconds(n, 0) == pytest.approx(
        65 * (WHOLE.prefill_seconds(n, 0) / 128 + 0.001))
    assert pipe.prefill_seconds(n, 0) / WHOLE.prefill_seconds(n, 0) < 0.52
    pipe.prefill_overhead_s, pipe.prefill_scale = 0.05, 2.0  # the live correction
    assert pipe.prefill_seconds(n, 0) == pytest.approx(
        0.05 + 2 * 65 * (WHOLE.prefill_seconds(n, 0) / 128 + 0.001))
    with pytest.raises(ValueError, match="2 or more stages"):
        PipelineCost(WHOLE, stages=1, chunk=256)


def test_a_group_is_calibrated_from_its_own_prefills() -> None:
    """A group whose prefills take twice the compute its pipelined profile says: the
    correction predicts the group's own times."""
    pipe = PipelineCost(WHOLE, stages=3, chunk=256)
    cal = PrefillCalibrator(pipe, refit_every=8)
    for n in (100, 300, 700, 1500, 3000, 6000, 9000, 12000):
        cal.observe_compute(n, 0, 2 * pipe.profile_prefill_seconds(n, 0))
    assert cal.refits == 1
    for n in (200, 5000, 20000):
        assert pipe.prefill_seconds(n, 0) == pytest.approx(
            2 * pipe.profile_prefill_seconds(n, 0), rel=1e-6)


def mixed() -> tuple[Conductor, RecordingMail]:
    """A group of 2 stages (prefill-0) and a single worker (prefill-1), both idle."""
    cfg = ClusterConfig(scheduler="kvcache_centric", prefill_workers=2, prefill_stages=2,
                        prefill_groups=1, slo=SLOConfig(ttft_s=1000, tbt_s=1000))
    mail = RecordingMail()
    c = Conductor(cfg, mail, clock=lambda: 1000.0)  # type: ignore[arg-type]
    c.on_register(replace(worker("prefill", 0), stages=2))
    for role, i in (("prefill", 1), ("decode", 0)):
        c.on_register(worker(role, i))
    for role, i in (("prefill", 0), ("prefill", 1), ("decode", 0)):
        c.on_heartbeat(beat(role, i, free=100))
    mail.take()
    return c, mail


def placed(c: Conductor, mail: RecordingMail, rid: str, n: int) -> str:
    c.on_submit(SubmitRequest(rid, list(range(n)), [], SamplingParams(max_tokens=1),
                              time.time()))
    mail.take()
    return c.tracker.get(rid).prefill_id


def test_short_prompts_skip_the_pipeline_and_long_ones_take_it() -> None:
    c, mail = mixed()
    group = c.placer.cost_of(2)
    assert isinstance(group, PipelineCost) and group.chunk == 256
    assert placed(c, mail, "short", 200) == "prefill-1"
    c2, mail2 = mixed()
    assert placed(c2, mail2, "long", 1200) == "prefill-0"  # 5 chunks: 0.6 of one worker


def test_a_groups_prefill_feeds_its_own_calibration() -> None:
    c, _ = mixed()
    c.placer.observe_prefill(PrefillDone("r", "prefill-0", 4000, 0, 0, 1.0, 0), 2, 1.2)
    c.placer.observe_prefill(PrefillDone("r", "prefill-1", 4000, 96, 0, 1.8, 0), 1)
    group, single = c.placer.shapes[2], c.placer.shapes[1]
    assert [s for _, s in group.computed] == [1.0] and [s for *_, s in group.alone] == [1.2]
    assert [s for _, s in single.computed] == [1.8] and not single.alone
    assert group.computed[0][0] == pytest.approx(c.placer.cost_of(2).profile_prefill_seconds(
        4000, 0))
