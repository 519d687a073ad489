"""The placement's view of each prefill queue, kept as requests come and go
(``prefill_queue.PrefillQueue``, ``common/scheduling/queued.py``), equals a pass over the
queue at the moment asked, as the placement computed it before: for random clusters of
placements, prefills landing, requests ending, refits of the cost model, prompts that
age past ``prefill_max_wait_s`` and shared prefixes."""
from __future__ import annotations

import random
import time

import pytest

from common.config import ClusterConfig, SLOConfig
from common.protocol import AbortRequest, BlocksReserved, PrefillDone, SubmitRequest
from common.sampling_params import SamplingParams
from services.conductor.prefill_queue import queued_waits, shared_prefix
from services.conductor.registry import WorkerState
from services.conductor.service import Conductor
from services.conductor.tracker import Phase
from tests.conductor.test_conductor import RecordingMail, beat, worker


def reference(c: Conductor, w: WorkerState, now: float, req: SubmitRequest) -> dict:
    """The queue as a pass over it gives it (the placement's code before 2026-11-29)."""
    placer, order = c.placer, c.placer.order
    cost = placer.cost_of(w.info.stages)
    waiting = sorted((t for t in w.assigned.values() if t.phase is not Phase.DECODING),
                     key=lambda t: t.accepted_at)
    left = [cost.prefill_compute_seconds(t.prefill_tokens,
                                         len(t.req.token_ids) - t.prefill_tokens)
            for t in waiting]
    if waiting:
        first = min(range(len(waiting)), key=lambda i: order.rank(
            waiting[i].prefill_tokens, waiting[i].accepted_at, now))
        start = waiting[first].accepted_at + waiting[first].predicted_ttft_s - left[first]
        left[first] -= min(left[first], max(0.0, now - start))
    queued = tuple((0 if order.aged(t.accepted_at, now) else t.prefill_tokens, s)
                   for t, s in zip(waiting, left))
    ends = []
    for t, s in zip(waiting, left):
        shared = shared_prefix(req.block_keys, t.keys)
        if shared:
            ends.append((shared, max(t.accepted_at + t.predicted_ttft_s - now, s)))
    backlog = c.config.prefill_preempt_backlog_s
    behind = backlog is not None and any(now - t.accepted_at >= backlog for t in waiting)
    return {"queue_s": sum(left), "queued": queued,
            "keys": queued_waits(req.block_keys, ends),
            "preempt": 0 if behind else c.config.prefill_preempt_tokens}


def check(c: Conductor, now: float, req: SubmitRequest) -> None:
    for w in c.registry.by_role("prefill"):
        want = reference(c, w, now, req)
        got = c.placer._prefill_state(w, c.tracker, now, req)
        assert got.queue_seconds == pytest.approx(want["queue_s"], rel=1e-9, abs=1e-12)
        assert got.preempt_tokens == want["preempt"]
        assert got.prefix_index.queued == pytest.approx(want["keys"], rel=1e-9)
        if c.placer.order.shortest:
            assert got.queued is not None
            entries = got.queued.entries()
            assert [tok for tok, _ in entries] == [tok for tok, _ in want["queued"]]
            assert [s for _, s in entries] == pytest.approx([s for _, s in want["queued"]],
                                                            rel=1e-9, abs=1e-12)
            for tokens in {1, 16, 100, 500, 2000, 10 ** 5,
                           *(tok for tok, _ in want["queued"])}:
                ahead = sum(s for tok, s in want["queued"] if tok <= tokens)
                longer = [e for e in want["queued"] if e[0] > tokens]
                assert got.queued.ahead_s(tokens) == pytest.approx(ahead, rel=1e-9,
                                                                   abs=1e-12)
                nxt = got.queued.next_longer(tokens)
                assert (nxt is None) == (not longer)
                if longer:
                    assert nxt is not None and nxt[0] == min(longer)[0]
                    assert nxt[1] == pytest.approx(min(longer)[1], rel=1e-9)
        else:
            assert got.queued is None


@pytest.mark.parametrize("seed", range(24))
def test_the_kept_queue_equals_a_pass_over_it(seed: int) -> None:
    rng = random.Random(seed)
    shortest = seed % 3 != 0
    cfg = ClusterConfig(scheduler=("kvcache_centric", "load_balance")[seed % 2],
                        prefill_order="shortest" if shortest else "arrival",
                        prefill_max_wait_s=rng.choice([2.0, 30.0]),
                        prefill_preempt_backlog_s=rng.choice([None, 3.0]),
                        max_queue=10_000, slo=SLOConfig(ttft_s=1e9, tbt_s=1e9))
    now = [1000.0]
    mail = RecordingMail()
    c = Conductor(cfg, mail, clock=lambda: now[0])  # type: ignore[arg-type]
    for role, count in (("prefill", 3), ("decode", 2)):
        for i in range(count):
            c.on_register(worker(role, i))
            c.on_heartbeat(beat(role, i, free=100))
    systems = [[f"s{k}-{b}" for b in range(rng.randint(1, 6))] for k in range(3)]
    live: list[str] = []

    sent: list[SubmitRequest] = []

    def prompt(rid: str) -> SubmitRequest:
        if sent and rng.random() < 0.25:  # the same prompt again (the same keys)
            again = rng.choice(sent)
            return SubmitRequest(rid, again.token_ids, again.block_keys,
                                 SamplingParams(max_tokens=8), time.time())
        blocks = rng.randint(1, 40)
        keys = list(rng.choice(systems)) if rng.random() < 0.6 else []
        keys += [f"{rid}-{b}" for b in range(len(keys), blocks)]
        tokens = len(keys) * 16 - rng.randint(0, 15)
        sent.append(SubmitRequest(rid, list(range(tokens)), keys,
                                  SamplingParams(max_tokens=8), time.time()))
        return sent[-1]

    for step in range(160):
        now[0] += rng.choice([0.0, 0.01, 0.3, 1.5])
        roll = rng.random()
        if roll < 0.5:
            req = prompt(f"r{step}")
            check(c, now[0], req)
            c.on_submit(req)
            t = c.tracker.get(req.request_id)
            mail.take()
            if t is not None:
                live.append(req.request_id)
                if rng.random() < 0.8:  # its decode worker reserved the blocks
                    c.on_reserved(BlocksReserved(req.request_id, t.decode_id, [0]))
                    mail.take()
        elif roll < 0.8 and live:  # a prefill lands, 0.5-2x as long as predicted
            t = c.tracker.get(rng.choice(live))
            if t is not None and t.phase is Phase.PREFILLING:
                seconds = c.placer.cost.prefill_compute_seconds(t.prefill_tokens, 0)
                c.on_prefill_done(PrefillDone(
                    t.req.request_id, t.prefill_id, len(t.req.token_ids), 0, 0,
                    seconds * rng.uniform(0.5, 2.0), 0, fence=t.fence))
        elif live:  # it ends (or is aborted) at any phase
            rid = live.pop(rng.randrange(len(live)))
            c.on_abort(AbortRequest(rid, "test"))
    check(c, now[0], prompt("last"))
    assert c.placer.calibrator.refits > 0  # the scales changed on the way

