"""Master + nodes as real processes; the client moves real bytes (shm and transfer engine)."""
from __future__ import annotations

import asyncio
import time

import pytest

from common.store.client import StoreClient
from tests.store.conftest import BLOCK, addrs, client_for, free_port, keys, same

@pytest.mark.parametrize("shm_node,shm_client", [(True, True), (True, False), (False, True)])
def test_put_get_byte_exact(cluster, transfer, buffers, shm_node, shm_client):
    src, dst = buffers
    address = cluster.master()
    cluster.node("a", shm=shm_node)
    cluster.node("b", shm=shm_node)

    async def go() -> None:
        c = await client_for(address, transfer, shm_client, shm_dir=cluster.tmp)
        ks = keys(8)
        assert await c.batch_put_from(ks, addrs(src, range(8)), BLOCK, replica_num=2) == 8
        assert await c.batch_put_from(ks[:4], addrs(src, range(4)), BLOCK) == 0  # present
        assert await c.longest_prefix(ks[:5] + keys(1) + ks[5:]) == 5
        dst[:] = 0
        ok = await c.batch_get_into(ks[::-1] + keys(1), addrs(dst, range(9)), BLOCK)
        assert ok == [True] * 8 + [False]
        assert all(same(src, dst, 7 - j, j) for j in range(8))
        assert (c.stats.hits, c.stats.misses, c.stats.puts, c.stats.put_skipped) == (8, 1, 8, 4)
        stats = await c.master_stats()
        a, b = cluster.ids["a"], cluster.ids["b"]  # two replicas, distinct nodes
        assert {n: s["dram_used"] for n, s in stats["nodes"].items()} == \
            {a: 8 * BLOCK, b: 8 * BLOCK}
        events, last = await c.poll_events(0)
        assert [e[1] for e in events] == ["stored"] * 8 and last == 8
        assert [e[2] for e in events] == [k.hex() for k in ks]
        await c.close()

    asyncio.run(go())


def test_killed_node_gives_misses_never_wrong_bytes(cluster, transfer, buffers):
    src, dst = buffers
    address = cluster.master()
    cluster.node("a", shm=False)
    cluster.node("b", shm=False)

    async def go() -> None:
        c = await client_for(address, transfer, use_shm=False, shm_dir=cluster.tmp)
        ks = keys(16)
        assert await c.batch_put_from(ks, addrs(src, range(16)), BLOCK) == 16
        cluster.nodes["b"].kill()
        cluster.nodes["b"].wait(5)
        dst[:] = 0
        ok = await c.batch_get_into(ks, addrs(dst, range(16)), BLOCK)  # before the timeout
        assert 0 < sum(ok) < 16
        assert all(same(src, dst, i, i) for i in range(16) if ok[i])
        await asyncio.sleep(1.6)  # heartbeat timeout 1.0 s + reaper tick
        present = await c.batch_exists(ks)
        assert present == ok  # exactly the dead node's objects are gone
        dst[:] = 0
        ok2 = await c.batch_get_into(ks, addrs(dst, range(16)), BLOCK)
        assert ok2 == ok and all(same(src, dst, i, i) for i in range(16) if ok2[i])
        missing = [i for i in range(16) if not ok[i]]
        stored = await c.batch_put_from([ks[i] for i in missing], addrs(src, missing), BLOCK)
        assert stored == len(missing)  # recompute → store again, on the survivor
        assert await c.batch_exists(ks) == [True] * 16
        assert list((await c.master_stats())["nodes"]) == [cluster.ids["a"]]
        await c.close()

    asyncio.run(go())


def test_ssd_offload_and_promotion_byte_exact(cluster, transfer, buffers):
    src, dst = buffers
    address = cluster.master(high_watermark=0.75, evict_fraction=0.25, lease_s=0.2)
    cluster.node("a", segment_mib=4, ssd_mib=32)  # 16 blocks of DRAM, 128 of SSD

    async def go() -> None:
        c = await client_for(address, transfer, use_shm=True, shm_dir=cluster.tmp)
        ks = keys(40)
        for i in range(0, 40, 4):
            assert await c.batch_put_from(ks[i:i + 4], addrs(src, range(i, i + 4)), BLOCK) == 4
            await asyncio.sleep(0.05)  # offloads complete, DRAM frees up
        stats = await c.master_stats()
        assert stats["counters"]["offloaded"] >= 24 and stats["objects"] == 40
        assert await c.batch_exists(ks) == [True] * 40
        dst[:] = 0
        for i in range(0, 40, 4):  # the oldest come back from SSD
            ok = await c.batch_get_into(ks[i:i + 4], addrs(dst, range(i, i + 4)), BLOCK)
            assert ok == [True] * 4
            await asyncio.sleep(0.25)  # leases lapse: these may be evicted again
        assert all(same(src, dst, i, i) for i in range(40))
        assert (await c.master_stats())["counters"]["promoted"] >= 24
        await c.close()

    asyncio.run(go())


def test_client_without_master_misses_within_deadline(transfer, buffers):
    src, dst = buffers

    async def go() -> None:
        c = StoreClient(f"tcp://127.0.0.1:{free_port()}", transfer, timeout_s=0.3)
        await c.start()
        t0 = time.monotonic()
        assert await c.batch_get_into(keys(2), addrs(dst, range(2)), BLOCK) == [False, False]
        assert await c.batch_put_from(keys(2), addrs(src, range(2)), BLOCK) == 0
        assert await c.longest_prefix(keys(3)) == 0
        assert time.monotonic() - t0 < 2.0
        await c.close()

    asyncio.run(go())


@pytest.mark.parametrize("shm", [True, False])  # the copy: memmove of a mapped file | TE read
def test_hot_objects_replicate_and_survive_their_first_node(cluster, transfer, buffers, shm):
    src, dst = buffers
    address = cluster.master(hot_read_threshold=4, hot_window_s=10, max_replicas=2)
    cluster.node("a", shm=shm)
    cluster.node("b", shm=shm)

    async def go() -> None:
        c = await client_for(address, transfer, use_shm=shm, shm_dir=cluster.tmp)
        ks = keys(4)
        assert await c.batch_put_from(ks, addrs(src, range(4)), BLOCK, replica_num=1) == 4
        stats = await c.master_stats()
        assert {n: s["dram_used"] for n, s in stats["nodes"].items()} == \
            {cluster.ids["a"]: 2 * BLOCK, cluster.ids["b"]: 2 * BLOCK}  # one replica each, spread over the nodes
        for _ in range(3):
            assert await c.batch_get_into(ks, addrs(dst, range(4)), BLOCK) == [True] * 4
        await asyncio.sleep(0.3)
        assert (await c.master_stats())["counters"]["replications"] == 0  # not hot yet
        assert await c.batch_get_into(ks, addrs(dst, range(4)), BLOCK) == [True] * 4
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            stats = await c.master_stats()
            if stats["counters"]["replications"] == 4:
                break
            await asyncio.sleep(0.05)
        assert stats["counters"]["replications"] == 4
        assert stats["counters"]["replications_failed"] == 0
        assert {n: s["dram_used"] for n, s in stats["nodes"].items()} == \
            {cluster.ids["a"]: 4 * BLOCK, cluster.ids["b"]: 4 * BLOCK}  # two replicas of each, on distinct nodes
        for _ in range(6):  # max_replicas: no further copies (there is no third node anyway)
            assert await c.batch_get_into(ks, addrs(dst, range(4)), BLOCK) == [True] * 4
        assert (await c.master_stats())["counters"]["replications"] == 4
        cluster.nodes["a"].kill()
        cluster.nodes["a"].wait(5)
        await asyncio.sleep(1.6)  # heartbeat timeout 1.0 s + reaper tick: "a" is dropped
        stats = await c.master_stats()
        b = cluster.ids["b"]
        assert list(stats["nodes"]) == [b] and stats["nodes"][b]["dram_used"] == 4 * BLOCK
        dst[:] = 0
        assert await c.batch_get_into(ks, addrs(dst, range(4)), BLOCK) == [True] * 4
        assert all(same(src, dst, i, i) for i in range(4))  # byte-exact from the copies
        await c.close()

    asyncio.run(go())
