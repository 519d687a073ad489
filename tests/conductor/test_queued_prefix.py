"""A prompt whose prefix a request queued ahead of it on the same prefill worker computes
is priced as cached there: the worker computes the earlier one first (FIFO)."""
from __future__ import annotations

from common.config import ClusterConfig, SLOConfig
from common.protocol import (RegisterWorker, RequestAccepted, SubmitRequest, WorkerHeartbeat,
                             WorkerLoad)
from common.sampling_params import SamplingParams
from services.conductor.service import Conductor


class Mail:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, address: str, msg: object) -> bool:
        self.sent.append(msg)
        return True


def conductor() -> tuple[Conductor, Mail]:
    mail = Mail()
    cfg = ClusterConfig(slo=SLOConfig(ttft_s=1000, tbt_s=1000), block_size=16,
                        cost_profile="cpu-smollm2-135m")
    c = Conductor(cfg, mail, clock=lambda: 1000.0)  # type: ignore[arg-type]
    for role in ("prefill", "decode"):
        c.on_register(RegisterWorker(f"{role}-0", role, f"tcp://w/{role}", "h:0", 4096, 1024,
                                     32, 1000, 16))
        c.on_heartbeat(WorkerHeartbeat(f"{role}-0", role, WorkerLoad(), 1000, 0, 1000, [], 0))
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
    accepted = {m.request_id: m for m in mail.sent if isinstance(m, RequestAccepted)}
    alone = c.placer.cost.prefill_seconds(645, 0)
    # turn2 waits for the first, then computes its tail only
    assert accepted["turn2"].predicted_ttft_s < alone + c.placer.cost.prefill_seconds(9, 640) + 1e-9
    assert accepted["turn2"].predicted_ttft_s > alone


def test_done_prompts_no_longer_count_unless_the_worker_reports_them() -> None:
    c, _ = conductor()
    submit(c, "first", blocks=10, tail=5)
    c.registry.release_prefill(c.tracker.get("first"))
    c.tracker.pop("first")
    submit(c, "later", blocks=10, tail=5)  # no KV event said the worker kept the blocks
    assert c.tracker.get("later").prefill_tokens == 10 * 16 + 5
