"""The store recovers, with real processes: a SIGKILLed master is restarted and relearns its
nodes, the conductor's global index converges to the new master's keys, a restarted node
removes its predecessor's /dev/shm file, and clients unmap dead nodes' segments."""
from __future__ import annotations

import asyncio
import glob
import os
import time
from typing import Awaitable, Callable

from common.config import ClusterConfig
from common.scheduling import PrefixIndex
from services.conductor.store_events import StoreEventFeed, Sync
from tests.store.conftest import BLOCK, addrs, client_for, keys, same


async def until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    """Seconds until ``check()`` holds; fails after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await check():
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout}s")


def index_keys(index: PrefixIndex, candidates: list[bytes]) -> set[str]:
    return {k.hex() for k in candidates if k.hex() in index}


def test_master_restart_nodes_reregister_and_the_index_converges(cluster, transfer, buffers):
    src, dst = buffers
    address = cluster.master()
    cluster.node("a")
    cluster.node("b")
    config = ClusterConfig.load(cluster.config)

    async def go() -> None:
        feed = StoreEventFeed(config, PrefixIndex())
        task = asyncio.create_task(feed.run())
        c = await client_for(address, transfer, use_shm=True, shm_dir=cluster.tmp)
        old, new = keys(4), keys(3)
        everything = old + new
        assert await c.batch_put_from(old, addrs(src, range(4)), BLOCK) == 4

        async def index_is(expected: list[bytes]) -> bool:
            return (feed.sync.state is Sync.LIVE
                    and index_keys(feed.index, everything) == {k.hex() for k in expected})

        await until(lambda: index_is(old), 5.0, "index of the first master's keys")
        first = feed.sync.incarnation

        cluster.restart_master()
        t0 = time.monotonic()

        async def relearned() -> bool:
            stats = await c.master_stats()
            return stats is not None and sorted(stats["nodes"]) == sorted(cluster.ids.values())

        nodes_s = await until(relearned, 10.0, "nodes registered with the new master")
        await until(lambda: index_is([]), 5.0, "the old master's keys dropped")
        assert feed.sync.incarnation not in (None, first)
        assert await c.batch_exists(old) == [False] * 4  # the new master starts empty
        assert await c.batch_put_from(new, addrs(src, range(4, 7)), BLOCK, replica_num=2) == 3
        dst[:] = 0
        assert await c.batch_get_into(new, addrs(dst, range(3)), BLOCK) == [True] * 3
        assert all(same(src, dst, 4 + i, i) for i in range(3))
        await until(lambda: index_is(new), 5.0, "index of the new master's keys")
        print(f"nodes re-registered {nodes_s:.2f}s, index converged "
              f"{time.monotonic() - t0:.2f}s after the master restart")
        assert feed.sync.resyncs >= 2  # the first snapshot, and one of the new master
        await c.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())


def test_feed_started_late_learns_existing_keys_and_forgets_a_dead_master(
        cluster, transfer, buffers):
    src, _ = buffers
    address = cluster.master()
    cluster.node("a")
    config = ClusterConfig.load(cluster.config)  # heartbeat_timeout_s = 1.0

    async def go() -> None:
        c = await client_for(address, transfer, use_shm=True, shm_dir=cluster.tmp)
        ks = keys(5)
        assert await c.batch_put_from(ks, addrs(src, range(5)), BLOCK) == 5
        assert await c.remove(ks[:1]) == 1
        feed = StoreEventFeed(config, PrefixIndex())  # a conductor (re)started now
        task = asyncio.create_task(feed.run())

        async def synced() -> bool:
            return feed.sync.state is Sync.LIVE

        await until(synced, 5.0, "first snapshot")
        assert index_keys(feed.index, ks) == {k.hex() for k in ks[1:]}
        cluster.kill_master()

        async def forgotten() -> bool:
            return feed.sync.state is Sync.WAITING and len(feed.index) == 0

        waited = await until(forgotten, 5.0, "index cleared after master silence")
        assert waited >= 0.5  # not before the silence timeout (1.0 s after the last beacon)
        await c.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())


def test_restarted_node_removes_its_dead_predecessors_file(cluster):
    cluster.master()
    a = cluster.node("a")
    b = cluster.node("b")

    def files(name: str) -> list[str]:
        return glob.glob(os.path.join(cluster.tmp, f"crescent-store-*-{cluster.ids[name]}-*"))

    old_a, old_b = files("a"), files("b")
    assert [f.rsplit("-", 1)[1] for f in old_a + old_b] == [str(a.pid), str(b.pid)]
    a.kill()
    a.wait(5)
    assert files("a") == old_a  # SIGKILL: the file is left behind
    new = cluster.restart_node("a")
    assert files("a") == [old_a[0].rsplit("-", 1)[0] + f"-{new.pid}"]  # old one gone
    assert files("b") == old_b  # a live node's file is untouched
    cluster.nodes["a"].terminate()  # a clean stop unlinks its own file
    cluster.nodes["a"].wait(10)
    assert files("a") == [] and files("b") == old_b


def test_client_unmaps_a_dead_nodes_segment(cluster, transfer, buffers):
    src, dst = buffers
    address = cluster.master()
    cluster.node("a")
    cluster.node("b")

    def mapped_here(path: str) -> bool:
        with open("/proc/self/maps") as fh:
            return any(path in line for line in fh)

    async def go() -> None:
        c = await client_for(address, transfer, use_shm=True, shm_dir=cluster.tmp)
        ks = keys(4)
        assert await c.batch_put_from(ks, addrs(src, range(4)), BLOCK, replica_num=2) == 4
        a, b = cluster.ids["a"], cluster.ids["b"]
        segments = c.mapped_segments()
        assert sorted(segments) == [a, b] and all(map(mapped_here, segments.values()))
        cluster.nodes["b"].kill()
        cluster.nodes["b"].wait(5)

        async def b_dropped() -> bool:
            stats = await c.master_stats()
            return stats is not None and list(stats["nodes"]) == [a]

        await until(b_dropped, 5.0, "the master dropping node b")
        assert c.mapped_segments() == segments  # nothing told the client yet
        dst[:] = 0
        assert await c.batch_get_into(ks, addrs(dst, range(4)), BLOCK) == [True] * 4
        assert all(same(src, dst, i, i) for i in range(4))  # from a's replicas
        assert c.mapped_segments() == {a: segments[a]}  # the reply's live list lacks b
        assert mapped_here(segments[a]) and not mapped_here(segments[b])
        await c.close()

    asyncio.run(go())
