"""Live prediction-based admission: the conductor's tracker feeds the decode slots, and
finished decodes feed the policy's duration history. Driven with a fake wall clock."""
from __future__ import annotations

from typing import Any

import pytest

from common.config import ClusterConfig, SLOConfig
from common.kv.events import KVEvents
from common.protocol import (
    BlocksReserved, PrefillDone, RegisterWorker, RequestFinished, RequestRejected,
    ReserveBlocks, SubmitRequest, WorkerHeartbeat, WorkerLoad,
)
from common.status_protocol import ClusterStatus
from common.sampling_params import SamplingParams
from common.scheduling import DecodeSlot, Rejection
from common.scheduling.decode_time import DecodeDurations
from services.conductor.placement import decode_slots
from services.conductor.service import Conductor

PROMPT, MAX_TOKENS = 40, 8  # each request may hold 48 tokens of KV on decode
# Retry after half the typical decode: the 10 s prior, no decode has finished.
FULL = Rejection("decode_full", 5.0, "no decode instance has room for 48 tokens "
                 "(prompt + max_tokens)")
BLOCK = 16


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Mail:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, address: str, msg: Any) -> bool:
        if not isinstance(msg, ClusterStatus):
            self.sent.append(msg)
        return True

    def last(self, rid: str) -> Any:
        return [m for m in self.sent if getattr(m, "request_id", None) == rid][-1]


def register(c: Conductor, role: str, free: int = 100) -> None:
    c.on_register(RegisterWorker(f"{role}-0", role, f"tcp://w/{role}", "h:0", 4096, 1024,
                                 32, 100, BLOCK))
    beat(c, role, free)


def beat(c: Conductor, role: str, free: int, running: int = 0, context: int = 0) -> None:
    c.on_heartbeat(WorkerHeartbeat(f"{role}-0", role, WorkerLoad(running=running,
                                   context_tokens=context), free, 100 - free, 100, KVEvents(), 0))


def submit(c: Conductor, rid: str, n: int = 1) -> None:
    c.on_submit(SubmitRequest(rid, list(range(PROMPT)), [],
                              SamplingParams(max_tokens=MAX_TOKENS, n=n), 0.0))


def make(admission: str) -> tuple[Conductor, Mail, Clock]:
    cfg = ClusterConfig(scheduler="kvcache_centric", admission=admission,
                        slo=SLOConfig(ttft_s=1000, tbt_s=1000))
    mail, clock = Mail(), Clock()
    c = Conductor(cfg, mail, clock=clock)  # type: ignore[arg-type]
    register(c, "prefill")
    return c, mail, clock


def start_decoding(c: Conductor, clock: Clock, rid: str, at: float) -> None:
    c.on_reserved(BlocksReserved(rid, "decode-0", [1, 2, 3]))
    clock.t = at
    c.on_prefill_done(PrefillDone(rid, "decode-0", PROMPT, 0, 0, 0.1, 1000, 0.01))


@pytest.mark.parametrize("admission, accepted", [("predicted", True), ("early", False)])
def test_running_decode_predicted_gone_frees_room(admission: str, accepted: bool) -> None:
    c, mail, clock = make(admission)
    register(c, "decode")
    submit(c, "r1")
    start_decoding(c, clock, "r1", at=1001.0)
    # r1 now holds the decode worker: room for 72 tokens, 40 of them r1's context.
    beat(c, "decode", free=2, running=1, context=PROMPT)
    # 20 s later, past the 10 s typical decode (the prior), r1 is predicted gone; the
    # current load still counts it (40 + 48 > 72).
    clock.t = 1021.0
    submit(c, "r2")
    msg = mail.last("r2")
    if accepted:  # placed: its decode blocks asked for (accepted once they are reserved)
        assert isinstance(msg, ReserveBlocks) and c.tracker.get("r2").decode_id == "decode-0"
    else:
        assert msg == RequestRejected("r2", FULL)


@pytest.mark.parametrize("admission, accepted", [("predicted", False), ("early", True)])
def test_incoming_request_counts_when_its_prefill_ends_first(admission: str,
                                                             accepted: bool) -> None:
    c, mail, clock = make(admission)
    register(c, "decode", free=4)  # room for 64 tokens, nothing running
    submit(c, "r1")
    assert isinstance(mail.last("r1"), ReserveBlocks)
    assert c.tracker.get("r1").predicted_ttft_s < 1
    # r1 (still reserving) joins decode before r2's prefill (queued behind r1's) ends,
    # and is still decoding then (TTFTs < 1 s, far below the 10 s prior): 48 + 48 > 64.
    # The current load has no context yet.
    clock.t = 1001.0
    submit(c, "r2")
    msg = mail.last("r2")
    if accepted:
        assert isinstance(msg, ReserveBlocks)
    else:
        assert msg == RequestRejected("r2", FULL)


def test_decode_slots_from_tracker() -> None:
    c, mail, clock = make("predicted")
    register(c, "decode")
    submit(c, "a")
    submit(c, "b")
    start_decoding(c, clock, "a", at=1003.0)
    ttft_b = c.tracker.get("b").predicted_ttft_s
    running, incoming = decode_slots(c.registry.get("decode-0"), now=1004.0)
    assert running == [DecodeSlot(1003.0, PROMPT + MAX_TOKENS)]
    assert incoming == [DecodeSlot(max(1000.0 + ttft_b, 1004.0), PROMPT + MAX_TOKENS)]


def test_a_requests_choices_count_as_sequences_on_its_decode_worker() -> None:
    """The worker reports running *sequences*; the placer counts the assigned requests'
    choices the same way, so one running n=3 request does not hide a pending one."""
    c, mail, clock = make("predicted")
    register(c, "decode")
    submit(c, "three", n=3)
    submit(c, "one")
    start_decoding(c, clock, "three", at=1003.0)
    running, incoming = decode_slots(c.registry.get("decode-0"), now=1004.0)
    assert [s.sequences for s in running] == [3] and [s.sequences for s in incoming] == [1]
    # what the decode worker reserves (common/kv/demand.py): 3 blocks of prompt and
    # output, and each further choice its own block from the prompt's partial one on
    assert running[0].tokens == (3 + 2 * 1) * BLOCK
    beat(c, "decode", free=90, running=3, context=3 * PROMPT)  # its 3 choices run
    state = c.placer._decode_state(c.registry.get("decode-0"), 1004.0)
    assert state.batch_size == 4  # 3 running + the pending request (was 3: 2 - 3 < 0)


def test_finished_decode_feeds_the_history_and_gauge() -> None:
    c, mail, clock = make("predicted")
    register(c, "decode")
    c.placer.policy.decode_durations = DecodeDurations(10.0, min_samples=1)
    history = c.placer.policy.decode_durations
    submit(c, "r")
    start_decoding(c, clock, "r", at=1002.0)
    clock.t = 1005.5
    c.on_finished(RequestFinished("r", "decode-0", "stop"))
    assert history.samples == 1
    assert history.mean() == pytest.approx(3.5)
    gauge = c.metrics.registry.get_sample_value("crescent_conductor_typical_decode_seconds")
    assert gauge == pytest.approx(3.5)


def test_finish_before_decode_adds_no_sample() -> None:
    c, mail, clock = make("predicted")
    register(c, "decode")
    submit(c, "r")
    c.on_finished(RequestFinished("r", "decode-0", "abort"))
    assert c.placer.policy.decode_durations.samples == 0
    gauge = c.metrics.registry.get_sample_value("crescent_conductor_typical_decode_seconds")
    assert gauge == 10.0  # the prior: SchedulerConfig.expected_decode_s


def test_configured_typical_decode_time_is_the_prior() -> None:
    from services.conductor.placement import Placer
    placer = Placer(ClusterConfig(admission="predicted", expected_decode_s=4.0))
    assert placer.policy.decode_durations.mean() == 4.0
    assert placer.policy.config.expected_decode_s == 4.0


def test_configured_transfer_bandwidth_prices_store_loads() -> None:
    """``transfer_bandwidth_bytes_per_s`` is what the scheduler prices a prefix load from the
    store at; left out, the cost profile's (1e9 bytes/s in the shipped one)."""
    from services.conductor.placement import Placer
    default = Placer(ClusterConfig())
    assert default.policy.transfer_seconds(10) == pytest.approx(
        10 * default.policy._block_bytes / 1e9)
    fast = Placer(ClusterConfig(transfer_bandwidth_bytes_per_s=4e9))
    assert fast.policy.transfer_seconds(10) == pytest.approx(default.policy.transfer_seconds(10) / 4)


def test_store_read_bandwidth_is_learned_from_prefills_loads() -> None:
    """Each PrefillDone says what its prefix load from the store took; from the third load
    of at least 4 MiB the scheduler prices a fetch at their bytes over their seconds (here
    2 GB/s, not the profile's 1 GB/s), and the gauge shows it. Small loads (mostly round
    trips) and a pinned ``transfer_bandwidth_bytes_per_s`` are left alone."""
    c, _, _ = make("predicted")
    policy = c.placer.policy
    profile_s = policy.transfer_seconds(10)
    mib = 1 << 20

    def done(rid: str, nbytes: int, seconds: float) -> None:
        c.on_prefill_done(PrefillDone(rid, "prefill-0", PROMPT, 64, 64, 0.1, 1000, 0.01,
                                      store_read_bytes=nbytes, store_read_s=seconds))

    done("tiny", 64 << 10, 1.0)  # 64 KiB in 1 s: a round trip, not bandwidth
    done("a", 8 * mib, 8 * mib / 1e9)
    done("b", 24 * mib, 24 * mib / 3e9)
    assert policy.transfer_seconds(10) == profile_s  # two loads: not yet
    assert c.metrics.registry.get_sample_value("crescent_conductor_store_read_bytes_per_s") == 0
    done("c", 16 * mib, 16 * mib / 2e9)
    learned = 48 * mib / (8 * mib / 1e9 + 24 * mib / 3e9 + 16 * mib / 2e9)
    assert learned == pytest.approx(2.0e9, rel=0.01)
    assert policy.transfer_seconds(10) == pytest.approx(profile_s * 1e9 / learned)
    assert c.metrics.registry.get_sample_value(
        "crescent_conductor_store_read_bytes_per_s") == pytest.approx(learned)

    from services.conductor.placement import Placer
    pinned = Placer(ClusterConfig(transfer_bandwidth_bytes_per_s=4e9))
    for rid in "abc":
        pinned.observe_store_read(PrefillDone(rid, "prefill-0", PROMPT, 64, 64, 0.1, 1000,
                                              store_read_bytes=8 * mib, store_read_s=1.0))
    assert pinned.store_reads.estimate == pytest.approx(8 * mib)  # learned, not applied
    assert pinned.policy.transfer_seconds(10) == pytest.approx(profile_s / 4)
