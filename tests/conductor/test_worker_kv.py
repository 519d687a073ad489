"""Worker KV events reach the conductor in order, numbered; a gap asks for a snapshot; a
restarted worker's old keys are dropped. The block pool, the heartbeat and snapshot code of
``WorkerRuntime``, the codec and the conductor are the real ones (exact keys and messages)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from common.config import ClusterConfig
from common.ipc import ProtocolError, decode, encode
from common.kv.block_pool import BlockPool
from common.kv.events import BlockStored, KVEvents
from common.protocol import (
    KVResync, KVSnapshot, RegisterWorker, StepTotals, WorkerHeartbeat, WorkerLoad,
)
from common.worker import WorkerRuntime
from services.conductor.service import Conductor
from services.conductor.worker_kv import WorkerKV
from tests.conductor.test_conductor import RecordingMail

K = [bytes([i]) * 16 for i in range(8)]
H = [k.hex() for k in K]
INBOX = "tcp://prefill-0"


def ev(first_seq: int, kinds: str, *keys: str) -> KVEvents:
    """A beat's events numbered from ``first_seq``: kinds ``s`` stored, ``r`` removed."""
    return KVEvents(first_seq, kinds, list(keys))


# ------------------------------------------------------------------ WorkerKV alone


def test_events_apply_in_order_within_one_beat() -> None:
    kv = WorkerKV()
    kv.apply(ev(1, "ssr", "a", "b", "a"), 3)
    assert kv.keys == {"b"} and kv.last_seq == 3  # stored then evicted: absent
    kv.apply(ev(4, "rs", "b", "b"), 5)
    assert kv.keys == {"b"}  # evicted then stored again: present
    kv.apply(ev(5, "r", "b"), 5)  # a replay of an applied event changes nothing
    assert (kv.keys, kv.gaps, kv.resyncing, kv.last_seq) == ({"b"}, 0, False, 5)
    kv.apply(ev(4, "rrs", "b", "b", "c"), 6)  # two applied already: only the third counts
    assert (kv.keys, kv.last_seq, kv.gaps) == ({"b", "c"}, 6, 0)


def test_a_gap_starts_a_resync_and_the_snapshot_ends_it() -> None:
    kv = WorkerKV()
    kv.apply(ev(1, "s", "a"), 1)
    kv.apply(ev(4, "s", "d"), 4)  # the beat with 2..3 was lost
    assert (kv.resyncing, kv.gaps, kv.keys, kv.last_seq) == (True, 1, {"a"}, 1)
    assert kv.snapshot_due(now=10.0, retry_s=1.0)
    assert not kv.snapshot_due(now=10.5, retry_s=1.0)  # asked; wait for the answer
    kv.apply(ev(5, "s", "e"), 5)  # dropped: the snapshot will cover it
    assert kv.keys == {"a"}
    assert kv.snapshot_due(now=11.0, retry_s=1.0)  # unanswered: ask again
    assert kv.on_snapshot(5, ["b", "d", "e"])
    assert (kv.resyncing, kv.keys, kv.last_seq, kv.resyncs) == (False, {"b", "d", "e"}, 5, 1)
    assert not kv.snapshot_due(now=20.0, retry_s=1.0)
    kv.apply(ev(5, "sr", "e", "d"), 6)  # 5: in the snapshot already
    assert kv.keys == {"b", "e"} and kv.last_seq == 6
    assert not kv.on_snapshot(5, ["x"])  # the answer to the first ask, late: stale
    assert kv.keys == {"b", "e"}


def test_a_lost_beat_shows_even_without_events() -> None:
    kv = WorkerKV()
    kv.apply(KVEvents(), 0)
    assert not kv.resyncing
    kv.apply(KVEvents(), 2)  # events 1..2 went out in a beat that never arrived
    assert kv.resyncing and kv.gaps == 1


def test_wire_events_are_validated() -> None:
    beat = WorkerHeartbeat("p", "prefill", WorkerLoad(), 1, 0, 1, ev(1, "sr", "ab", "cd"), 2)
    assert decode(encode(beat)) == beat
    for good, bad, why in ((b'"kinds":"sr"', b'"kinds":"sx"', "kinds are 's'"),
                           (b'"kinds":"sr"', b'"kinds":"s"', "1 kinds for 2 keys"),
                           (b'"first_seq":1', b'"first_seq":0', "first_seq must be positive"),
                           (b'"keys":["ab","cd"]', b'"keys":["ab",4]', "wrong type")):
        with pytest.raises(ProtocolError, match=why):
            decode(encode(beat).replace(good, bad))
    with pytest.raises(ValueError, match="not a run"):  # a pool numbers one by one
        KVEvents.of([BlockStored(1, b"a", 0), BlockStored(3, b"b", 1)])


# ------------------------------------------------------- worker → conductor, in process


class Worker:
    """The real heartbeat and KVResync code of WorkerRuntime over a real block pool."""

    def __init__(self, epoch: int) -> None:
        self.sent: list[Any] = []
        self.rt = SimpleNamespace(
            instance_id="prefill-0", role="prefill", epoch=epoch, inbox_address=INBOX,
            conductor="tcp://conductor", engine=SimpleNamespace(pool=BlockPool(8)),
            mail=SimpleNamespace(send=lambda address, msg: self.sent.append(msg) or True,
                                 dropped={}), dropped={}, available=lambda: True, kv_bytes=dict,
            decode_steps=StepTotals)
        self.pool: BlockPool = self.rt.engine.pool

    def registration(self) -> RegisterWorker:
        return RegisterWorker("prefill-0", "prefill", INBOX, "h:1", 4096, 1024, 32, 8, 16,
                              epoch=self.rt.epoch)

    def beat(self) -> WorkerHeartbeat:
        msg = WorkerRuntime.heartbeat(self.rt, WorkerLoad())  # type: ignore[arg-type]
        return decode(encode(msg))  # over the wire

    def cache(self, keys: list[bytes]) -> list[int]:
        blocks = self.pool.allocate(len(keys))
        self.pool.cache_full_blocks(blocks, keys)
        self.pool.free(blocks)
        return blocks

    def evict(self, n: int) -> None:
        self.pool.free(self.pool.allocate(n))  # reuses the oldest free blocks, cached last


@pytest.fixture
def conductor() -> tuple[Conductor, RecordingMail]:
    mail = RecordingMail()
    return Conductor(ClusterConfig(), mail), mail  # type: ignore[arg-type]


def resyncs(mail: RecordingMail) -> list[tuple[str, Any]]:
    return [(a, m) for a, m in mail.sent if isinstance(m, KVResync)]


def started(c: Conductor, epoch: int, keys: list[bytes]) -> Worker:
    """A worker incarnation registered, ``keys`` cached and reported in one beat."""
    w = Worker(epoch)
    c.on_register(w.registration())
    w.cache(keys)
    c.on_heartbeat(w.beat())
    return w


def test_stored_and_evicted_within_one_beat_is_absent(conductor) -> None:
    c, _ = conductor
    w = Worker(epoch=1)
    c.on_register(w.registration())
    w.cache(K[:2])
    w.evict(8)  # every block reused: both keys evicted before the next beat
    w.cache(K[2:3])
    beat = w.beat()
    # K0, K1 stored; K1, K0 removed (freed tail first, evicted in that order); K2 stored
    assert beat.events == KVEvents(1, "ssrrs", [H[0], H[1], H[1], H[0], H[2]])
    c.on_heartbeat(beat)
    assert c.registry.get("prefill-0").cached_keys == {H[2]}


def test_lost_beat_gets_a_resync_and_the_snapshot_fixes_the_keys(conductor) -> None:
    c, mail = conductor
    w = started(c, 1, K[:2])
    w.evict(8)
    w.beat()  # lost: it said K0 and K1 were evicted
    w.cache(K[2:4])
    c.on_heartbeat(w.beat())
    state = c.registry.get("prefill-0")
    assert state.kv.resyncing and state.cached_keys == {H[0], H[1]}  # stale until the snapshot
    c.sweep()
    assert resyncs(mail) == [(INBOX, KVResync("prefill-0"))]
    c.sweep()
    assert len(resyncs(mail)) == 1  # asked once per retry interval, not per sweep
    assert c.metrics.kv_resyncs._value.get() == 1
    WorkerRuntime.on_kv_resync(w.rt, KVResync("prefill-0"))  # type: ignore[arg-type]
    snapshot = decode(encode(w.sent[-1]))
    assert isinstance(snapshot, KVSnapshot)
    assert (snapshot.epoch, snapshot.event_seq, sorted(snapshot.keys)) == (1, 6, [H[2], H[3]])
    c.on_kv_snapshot(snapshot)
    assert not state.kv.resyncing and state.cached_keys == {H[2], H[3]}
    w.cache(K[4:5])
    c.on_heartbeat(w.beat())
    assert state.cached_keys == {H[2], H[3], H[4]}


def test_restarted_worker_loses_its_old_keys(conductor) -> None:
    c, mail = conductor
    old = started(c, 1, K[:3])
    assert c.registry.get("prefill-0").cached_keys == {H[0], H[1], H[2]}
    new = Worker(epoch=2)  # SIGKILLed and started again: an empty pool
    c.on_register(new.registration())
    assert c.registry.get("prefill-0").cached_keys == set()
    c.on_heartbeat(old.beat())  # a late beat of the old process: not applied
    c.on_kv_snapshot(KVSnapshot("prefill-0", 1, 3, [H[0]]))  # nor its snapshot
    assert c.registry.get("prefill-0").cached_keys == set()
    new.cache(K[5:6])
    c.on_heartbeat(new.beat())
    assert c.registry.get("prefill-0").cached_keys == {H[5]}
    c.sweep()
    assert resyncs(mail) == []  # the new incarnation's events are complete
