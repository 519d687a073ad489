"""Stale work after a restart or a false timeout, on a whole cluster in one process
(tests/conductor/mini_cluster.py: real conductor and worker objects, KV bytes really
copied): old PrefillTasks and old KV completion messages are replayed, a prefill worker
given up for dead keeps writing; no request's output changes, and no block is read by a
request other than the one whose KV was written into it."""
from __future__ import annotations

import asyncio
import threading

from common.protocol import (
    BlocksReserved, KVFailed, KVReady, PrefillDone, PrefillTask, RequestFailed,
    RequestFinished,
)
from tests.conductor.mini_cluster import MiniCluster
from tests.conductor.test_failure_policy import silence

A, B, C = list(range(1, 11)), list(range(21, 31)), list(range(41, 51))


def clean_outputs() -> dict[str, list[int]]:
    """What A, B and C stream on a cluster where nothing goes wrong."""
    mc = MiniCluster(decode_blocks=8)
    mc.start_prefill("prefill-0", epoch=1)
    out: dict[str, list[int]] = {}

    async def go() -> None:
        for rid, tokens in (("A", A), ("B", B), ("C", C)):
            mc.submit(rid, tokens)
            await mc.run_until(lambda: mc.output(rid) is not None)
            out[rid] = mc.output(rid)

    asyncio.run(go())
    return out


def own_kv_only(mc: MiniCluster, prompts: dict[tuple[int, ...], list[int]]) -> None:
    """Every decode read its own prompt back from its blocks, slot for slot."""
    assert mc.drt.engine.reads
    for table, context in mc.drt.engine.reads:
        prompt = prompts[table]
        assert context[:len(prompt)] == prompt


def idle(mc: MiniCluster) -> None:
    assert mc.decode.idle() and mc.decode.idle_check.run()
    assert all(p.idle() and p.idle_check.run() for p in mc.prefills)
    assert mc.conductor.tracker.requests == {}


def test_old_tasks_and_kv_messages_replayed_after_a_restart_change_nothing() -> None:
    want = clean_outputs()
    mc = MiniCluster(decode_blocks=4)  # one reservation at a time: B reuses A's blocks
    old = mc.start_prefill("prefill-0", epoch=1)

    async def go() -> None:
        mc.submit("A", A)
        await mc.run_until(lambda: mc.output("A") is not None and mc.decode.idle())
        task_a = mc.sent(PrefillTask)[0]
        stale = [(task_a.decode_inbox, m) for m in mc.sent(KVReady)] + [
            (task_a.decode_inbox, KVFailed("A", "aborted", task_a.fence))] + [
            ("tcp://conductor", m) for kind in (BlocksReserved, PrefillDone, RequestFinished)
            for m in mc.sent(kind)] + [
            ("tcp://conductor", RequestFailed("A", 504, "timeout", "late", fence=task_a.fence))]
        new = mc.start_prefill("prefill-0", epoch=2)  # restarted: the same inbox
        mc.submit("B", B)
        await mc.run_until(lambda: len(mc.sent(BlocksReserved)) == 2)
        task_b_fence = mc.sent(BlocksReserved)[1].fence
        assert sorted(mc.sent(BlocksReserved)[1].block_ids) == task_a.decode_block_ids
        # B's reservation is live in A's old blocks: replay everything of A's now.
        for address, msg in stale:
            await mc.deliver(address, msg)
        await mc.deliver("tcp://prefill-0", task_a)  # to the new incarnation
        old.on_task(task_a)  # and to the old one, were it alive
        assert mc.decode.reserved["B"].fence == task_b_fence
        await mc.run_until(lambda: mc.output("B") is not None and mc.decode.idle())
        assert (new.dropped, old.dropped) == ({"epoch": 1}, {"duplicate": 1})
        assert mc.decode.dropped == {"KVReady": 1, "KVFailed": 1}

    asyncio.run(go())
    assert {"A": mc.output("A"), "B": mc.output("B")} == {"A": want["A"], "B": want["B"]}
    tables = {r.fence.generation: tuple(r.block_ids) for r in mc.sent(BlocksReserved)}
    assert set(tables[1]) == set(tables[2])  # the very same blocks, each read its own KV
    own_kv_only(mc, {tables[1]: A, tables[2]: B})
    assert [c[:10] for t, c in mc.drt.engine.reads] == [A] * 3 + [B] * 3
    idle(mc)


def test_a_prefill_given_up_for_dead_that_keeps_writing_harms_nobody() -> None:
    """prefill-0 misses its heartbeats mid-prefill (it is only slow): C is re-run on
    prefill-1 in fresh blocks while prefill-0 goes on to write C's KV into the first
    reservation's, which stay out of the pool. prefill-0's KVReady for that fence, landing
    before the re-run's KV, frees them and starts nothing; D then gets those blocks and
    reads only its own KV, and C runs on the re-run's."""
    want = clean_outputs()
    mc = MiniCluster(decode_blocks=8)  # two reservations of 4 blocks
    slow, other = mc.start_prefill("prefill-0", epoch=1), mc.start_prefill("prefill-1", 1)
    slow.engine.gate, other.engine.gate = gate0, gate1 = threading.Event(), threading.Event()

    async def go() -> None:
        mc.submit("C", C)
        await mc.run_until(lambda: bool(slow.engine.steps) or bool(other.engine.steps))
        assert slow.engine.steps, "C was placed on prefill-0"
        silence(mc.conductor, "prefill-0")  # a false timeout: it is alive and computing
        await mc.run_until(lambda: bool(other.engine.steps))  # the re-run, held too
        first, rerun = mc.sent(BlocksReserved)
        assert list(mc.decode.quarantine) == [first.fence.generation]
        assert set(first.block_ids).isdisjoint(rerun.block_ids)
        gate0.set()  # prefill-0 writes C's KV into the first reservation, then KVReady
        await mc.run_until(lambda: not mc.decode.quarantine)
        assert list(mc.decode.reserved) == ["C"] and not mc.decode.running  # still waits
        mc.submit("D", B)
        await mc.run_until(lambda: len(mc.sent(BlocksReserved)) == 3)
        assert sorted(mc.sent(BlocksReserved)[2].block_ids) == sorted(first.block_ids)
        gate1.set()
        await mc.run_until(lambda: mc.output("C") is not None and mc.output("D") is not None
                           and mc.decode.idle() and all(p.idle() for p in mc.prefills))

    asyncio.run(go())
    assert [mc.output("C"), mc.output("D")] == [want["C"], want["B"]]
    assert mc.conductor.metrics.reruns._value.get() == 1
    assert mc.decode.dropped == {}  # the late KVReady was the quarantine's release
    assert sorted(c[:10] for t, c in mc.drt.engine.reads) == sorted([C] * 3 + [B] * 3)
    blocks = {r.request_id: tuple(r.block_ids) for r in mc.sent(BlocksReserved)[1:]}
    own_kv_only(mc, {blocks["C"]: C, blocks["D"]: B})
    idle(mc)
