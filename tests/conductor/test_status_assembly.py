"""What the conductor adds to ClusterStatus for the dashboard: per-worker detail from the
registry, its totals read back from its counters, the store master's usage, each prefill's
figures once; and the status still decodes from a conductor that sends none of it."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from common.config import ClusterConfig
from common.ipc import decode, encode
from common.kv.events import KVEvents
from common.protocol import (
    BlocksReserved, PrefillDone, PrefillTask, RegisterWorker, WorkerHeartbeat, WorkerLoad,
)
from common.status_protocol import (
    ClusterStatus, ConductorTotals, InstanceStatus, PrefillSummary,
)
from common.scheduling import PrefixIndex
from services.store_master.metadata import MetadataConfig, StoreMetadata
from services.conductor.metrics import ConductorMetrics
from services.conductor.registry import Registry
from services.conductor.status import StoreView, conductor_totals, store_usage
from services.conductor.store_events import IndexSync
from tests.conductor.test_conductor import beat, started, submit, worker


def test_registry_status_has_each_workers_detail() -> None:
    reg = Registry(heartbeat_timeout_s=3.0)
    reg.register(RegisterWorker("prefill-0", "prefill", "tcp://p0", "s:1", 0, 64, 8, 100, 16,
                                epoch=1), now=10.0)
    reg.register(RegisterWorker("decode-0", "decode", "tcp://d0", "s:2", 0, 64, 8, 200, 16,
                                epoch=1), now=10.0)
    events = KVEvents(1, "ss", ["aa", "bb"])
    assert reg.heartbeat(WorkerHeartbeat("prefill-0", "prefill", WorkerLoad(
        queued=2, queued_tokens=300), 90, 10, 100, events, 2, epoch=1, draining=True),
        now=11.0)
    decode_0, prefill_0 = reg.status(now=11.5)
    assert prefill_0 == InstanceStatus(
        "prefill-0", "prefill", total_blocks=100, free_blocks=90, used_blocks=10, queued=2,
        running=0, assigned=0, queued_tokens=300, context_tokens=0, cached_blocks=2,
        draining=True, heartbeat_age_s=0.5)
    assert (decode_0.free_blocks, decode_0.used_blocks, decode_0.heartbeat_age_s) == \
        (200, 0, 1.5)  # no heartbeat yet: all free, aged from its registration


def test_totals_are_the_metrics_counters() -> None:
    m = ConductorMetrics()
    m.placed.labels(prefill="p0", decode="d0").inc(3)
    m.placed.labels(prefill="p1", decode="d0").inc(2)
    m.rejected.labels(reason="ttft_slo").inc(4)
    m.rejected.labels(reason="queue_full").inc()
    m.failed.labels(reason="worker_lost").inc()
    m.prompt_tokens.inc(1000)
    m.cached_tokens.inc(300)
    m.global_hit_tokens.inc(100)
    m.transfer_bytes.inc(4096)
    m.transfer_seconds.observe(0.25)
    m.transfer_seconds.observe(0.5)
    assert conductor_totals(m) == ConductorTotals(
        placed=5, rejected={"ttft_slo": 4, "queue_full": 1}, failed={"worker_lost": 1},
        prompt_tokens=1000, cached_tokens=300, global_hit_tokens=100, transfer_bytes=4096,
        transfers=2, transfer_seconds=0.75)
    assert conductor_totals(ConductorMetrics()) == ConductorTotals()


def test_each_prefill_is_counted_once_and_told_in_the_next_status() -> None:
    """The conductor is the one place that counts KV transfers: a PrefillDone goes into
    its counters, and the next status carries them and the request's figures, once."""
    c, mail = started(2, [(worker(r, i), beat(r, i)) for r, i in (("prefill", 0),
                                                                    ("decode", 0))])
    c.on_submit(submit("r1"))
    c.on_reserved(BlocksReserved("r1", "decode-0", [5, 6, 7]))
    [task] = [m for _, m in mail.take() if isinstance(m, PrefillTask)]
    c.on_prefill_done(PrefillDone("r1", "prefill-0", 40, 0, 0, 0.1, 1000, 0.02, task.fence,
                                  wait_s=0.03))
    assert mail.sent == []  # nothing to the router until the sweep

    def swept() -> ClusterStatus:
        c.sweep()
        [status] = [m for _, m in mail.sent if isinstance(m, ClusterStatus)]
        mail.sent = []
        return status

    first, second = swept(), swept()
    assert first.prefills == [PrefillSummary("r1", 0.1, 0.03, 0.02, 1000)]
    assert second.prefills == []
    for status in (first, second):
        assert (status.totals.transfer_bytes, status.totals.transfers,
                status.totals.transfer_seconds) == (1000, 1, 0.02)


def test_store_usage_sums_the_masters_nodes() -> None:
    md = StoreMetadata(MetadataConfig(put_timeout_s=10.0, lease_s=5.0, high_watermark=0.9,
                                      evict_fraction=0.2, heartbeat_timeout_s=3.0))
    md.add_node("n0", 8192, 0, {"session_id": "s0"}, now=0.0)
    md.add_node("n1", 4096, 1 << 20, {"session_id": "s1"}, now=0.0)
    slots = md.put_start(["a", "b"], 1024, 1, 0.0)
    md.put_end(["a", "b"], [True, True], 0.0)
    md.get(["a", "zz"], now=1.0)
    usage = store_usage(md.stats())
    assert len(slots) == 2
    assert (usage.nodes, usage.objects, usage.dram_used, usage.dram_capacity,
            usage.ssd_used, usage.ssd_capacity) == (2, 2, 2048, 12288, 0, 1 << 20)
    assert (usage.counters["hits"], usage.counters["misses"]) == (1, 1)
    with pytest.raises(ValueError, match="malformed store stats"):
        store_usage({"nodes": {"n0": {"dram_used": 1}}, "objects": 0, "counters": {}})
    with pytest.raises(ValueError):
        store_usage({"nodes": [], "objects": "x", "counters": {}})


def test_store_view_ages_its_last_answer_and_adds_the_index() -> None:
    sync = IndexSync(PrefixIndex())
    view = StoreView(ClusterConfig(), sync)
    assert view.usage() is None  # no answer yet: nothing is made up
    view.last = store_usage({"nodes": {}, "objects": 0, "counters": {}})
    view.last_at = 100.0
    usage = view.usage(now=102.5)
    assert (usage.age_s, usage.index_keys, usage.index_state) == (2.5, 0, "waiting")


def test_store_view_without_a_master_gives_up_within_its_deadline() -> None:
    cfg = ClusterConfig.load(None, {"base_port": 21290})  # nothing listens there

    async def once() -> bool:
        view = StoreView(cfg, None)
        view.client.timeout_s = 0.2
        await view.client.start()
        try:
            return await view.poll()
        finally:
            await view.client.close()

    assert asyncio.run(asyncio.wait_for(once(), 5.0)) is False


def test_status_round_trips_and_an_old_one_still_decodes() -> None:
    store = store_usage({"nodes": {"n0": {"dram_used": 1, "dram_capacity": 2, "ssd_used": 0,
                                          "ssd_capacity": 0}},
                         "objects": 1, "counters": {"hits": 3}})
    status = ClusterStatus(True, [InstanceStatus("p", "prefill", 1, 1, 0, 0, 0, 0,
                                                 cached_blocks=7)], 9,
                           ConductorTotals(placed=2, rejected={"ttft_slo": 1}), store,
                           [PrefillSummary("r", 0.1, 0.02, 0.05, 4096)])
    assert decode(encode(status)) == status
    old = {"type": "ClusterStatus", "ready": True, "conductor_epoch": 3, "instances": [
        {"instance_id": "p", "role": "prefill", "total_blocks": 1, "free_blocks": 1,
         "used_blocks": 0, "queued": 0, "running": 0, "assigned": 0}]}
    got = decode(orjson.dumps(old))
    assert got.totals is None and got.store is None and got.instances[0].cached_blocks == 0
    assert got.prefills == []
