"""Byte-range puts and gets against a real master and node: several writers ("pipeline
stages", each with its own transfer engine and memory) fill one object layer by layer."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from common.ipc import decode, encode, message, ProtocolError
from common.store.plans import GetPlan, Location, NodeRef, PutPlan, Replicas, node_refs
from common.store.ranges import RangeMover
from common.transfer import TransferAgent, TransferConfig, TransferError
from tests.store.conftest import client_for, keys

LAYERS, LAYER = 4, 64 << 10  # an object: 4 layer slices of 64 KiB
SIZE = LAYERS * LAYER
N = 3  # objects per test


@message
class RangesTestCarrier:
    """Test only: plans ride inside messages like this one."""
    put: PutPlan
    get: GetPlan


@pytest.fixture(scope="module")
def stage_b():
    """A second "stage" process's transfer engine and its own registered memory."""
    agent = TransferAgent(TransferConfig())
    mem = np.zeros(N * SIZE, dtype=np.uint8)
    agent.register(mem.ctypes.data, mem.nbytes)
    yield agent, mem
    agent.close()


def stage_a(buffers) -> tuple[np.ndarray, np.ndarray]:
    """The first stage's memory (the session's registered buffers): a source, a sink."""
    src, dst = buffers
    return src[:N * SIZE], dst[:N * SIZE]


def layer_items(mem: np.ndarray, layers: range) -> list[tuple[int, int, int, int]]:
    """Every object's slices of ``layers``: object i lives at mem[i*SIZE:(i+1)*SIZE]."""
    return [(i, mem.ctypes.data + i * SIZE + l * LAYER, l * LAYER, LAYER)
            for i in range(N) for l in layers]


def test_plans_roundtrip_through_ipc():
    nodes = [NodeRef("n0", "127.0.0.1:1", 4096, 1 << 20, "/dev/shm/x", 3, "h")]
    put = PutPlan(SIZE, ["aa", "bb"], [0, 2], [Replicas([Location("n0", 0)]),
                                               Replicas([Location("n0", SIZE)])],
                  nodes, 123.5, ["n0"])
    get = GetPlan(SIZE, ["aa", "cc"], [Replicas([Location("n0", 0)]), Replicas()], nodes,
                  124.0)
    msg = decode(encode(RangesTestCarrier(put, get)))
    assert msg == RangesTestCarrier(put, get)
    assert msg.get.present() == [True, False]
    assert isinstance(msg.put.replicas[1].locations[0], Location)
    assert NodeRef.from_info("n0", {"session_id": "127.0.0.1:1", "base": 4096,
                                    "shm_path": "/dev/shm/x", "hostname": "h", "epoch": 3,
                                    "segment_bytes": 1 << 20}) == nodes[0]
    with pytest.raises(ValueError, match="bad node info"):
        node_refs({"n1": {"base": 0}})
    bad = encode(RangesTestCarrier(put, get)).replace(b'"index":[0,2]', b'"index":[0]')
    with pytest.raises(ProtocolError, match="2 keys but 1 positions"):
        decode(bad)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "transfer-engine"])
def test_two_stages_write_layers_then_whole_and_layerwise_reads(cluster, transfer, buffers,
                                                                 stage_b, shm):
    src, dst = stage_a(buffers)
    agent_b, mem_b = stage_b
    address = cluster.master()
    cluster.node("a")
    cluster.node("b")

    async def go() -> None:
        c = await client_for(address, transfer, use_shm=shm, shm_dir=cluster.tmp)
        # the transfer engine where shm is off: a by choice, b with no shm dir to map from
        a = RangeMover(transfer, cluster.tmp, use_shm=shm)
        b = RangeMover(agent_b, cluster.tmp if shm else None)
        mem_b[:] = src  # stage b computed the same KV for its own layers
        ks = keys(N)
        moved_b = agent_b.bytes_moved
        plan = await c.start_put(ks, SIZE, replica_num=2)
        assert plan is not None and plan.index == list(range(N))
        shipped = decode(encode(RangesTestCarrier(plan, GetPlan(SIZE, [], [], [], 0.0)))).put
        for layer in range(LAYERS):  # layer by layer, as computed
            mover, mem = (a, src) if layer < 2 else (b, mem_b)
            await asyncio.to_thread(mover.write, shipped, layer_items(mem, range(layer,
                                                                                layer + 1)))
        # stage b wrote its 2 layers of N objects to 2 replicas, by itself unless mapped
        assert agent_b.bytes_moved - moved_b == (0 if shm else 2 * N * 2 * LAYER)
        assert await c.batch_exists(ks) == [False] * N  # written, not committed: invisible
        assert await c.batch_get_into(ks, [dst.ctypes.data] * N, SIZE) == [False] * N
        assert await c.end_put(plan, [True] * N) == N
        assert (await c.master_stats())["objects"] == N
        dst[:] = 0
        ok = await c.batch_get_into(ks, [dst.ctypes.data + i * SIZE for i in range(N)], SIZE)
        assert ok == [True] * N and np.array_equal(src, dst)

        dst[:] = 0
        get = await c.plan_get(ks, SIZE)
        assert get is not None and get.present() == [True] * N
        reader = b  # another process reads layer by layer under the same plan
        for layer in range(LAYERS):
            await asyncio.to_thread(reader.read, get, layer_items(dst, range(layer, layer + 1)))
            assert np.array_equal(src.reshape(N, LAYERS, LAYER)[:, :layer + 1],
                                  dst.reshape(N, LAYERS, LAYER)[:, :layer + 1])
        assert bool(a.mapped()) == shm and bool(b.mapped()) == shm
        assert (a.errors, b.errors) == (0, 0)
        a.close()
        b.close()
        await c.close()

    asyncio.run(go())


def test_late_write_raises_and_commits_nothing_absent_read_raises(cluster, transfer, buffers):
    src, dst = stage_a(buffers)
    address = cluster.master(put_timeout_s=0.4)  # writes must end within 0.2 s of asking
    cluster.node("a")

    async def go() -> None:
        c = await client_for(address, transfer, use_shm=True, shm_dir=cluster.tmp)
        mover = RangeMover(transfer, cluster.tmp)
        ks = keys(N)
        plan = await c.start_put(ks, SIZE)
        assert plan is not None and 0 < plan.deadline - time.time() <= 0.2
        mover.write(plan, layer_items(src, range(0, 1)))  # in time: fine
        with pytest.raises(ValueError, match="not within an object"):
            mover.write(plan, [(0, src.ctypes.data, SIZE - 8, 16)])
        with pytest.raises(ValueError, match="key position 3"):
            mover.write(plan, [(3, src.ctypes.data, 0, 16)])
        await asyncio.sleep(plan.deadline - time.time() + 0.01)
        with pytest.raises(TransferError, match="past the deadline"):
            mover.write(plan, layer_items(src, range(1, LAYERS)))
        assert await c.end_put(plan, [False] * N) == 0
        assert await c.batch_exists(ks) == [False] * N
        assert await c.batch_get_into(ks, [dst.ctypes.data] * N, SIZE) == [False] * N
        assert c.stats.put_failed == N

        stored = keys(1)
        assert await c.batch_put_from(stored, [src.ctypes.data], SIZE) == 1
        get = await c.plan_get([stored[0], ks[0]], SIZE)
        assert get is not None and get.present() == [True, False]
        mover.read(get, [(0, dst.ctypes.data, LAYER, LAYER)])
        assert np.array_equal(dst[:LAYER], src[LAYER:2 * LAYER])
        with pytest.raises(TransferError, match="1 of 2 ranges failed"):
            mover.read(get, [(0, dst.ctypes.data, 0, LAYER), (1, dst.ctypes.data, 0, LAYER)])
        node = get.replicas[0].locations[0].node_id
        far = GetPlan(SIZE, get.keys[:1], [Replicas([Location(node, 16 << 20)])], get.nodes,
                      get.deadline)  # a location past the node's 16 MiB segment: refused
        with pytest.raises(TransferError, match="1 of 1 ranges failed"):
            mover.read(far, [(0, dst.ctypes.data, 0, LAYER)])
        late = GetPlan(get.size, get.keys, get.replicas, get.nodes, time.time() - 1)
        with pytest.raises(TransferError, match="past the deadline"):
            mover.read(late, [(0, dst.ctypes.data, 0, LAYER)])
        mover.close()
        await c.close()

    asyncio.run(go())


def test_a_layer_read_from_same_host_segments_at_once(cluster, transfer, buffers):
    """``read_same_host``: a layer of every object, from two nodes' segments, into its
    place in local memory, by numpy's row copies: the bytes ``read`` gives; False where a
    segment is not mapped here (nothing copied); errors as ``read``'s."""
    src, dst = stage_a(buffers)
    address = cluster.master()
    cluster.node("a")
    cluster.node("b")

    async def go() -> None:
        c = await client_for(address, transfer, use_shm=True, shm_dir=cluster.tmp)
        mover = RangeMover(transfer, cluster.tmp)
        ks = keys(N)
        assert await c.batch_put_from(ks, [src.ctypes.data + i * SIZE for i in range(N)],
                                      SIZE) == N
        get = await c.plan_get(ks, SIZE)
        by_node = get.first_replicas()
        assert by_node is not None and sorted(np.concatenate([k for k, _ in by_node.values()])
                                              ) == list(range(N))
        at = np.arange(N, dtype=np.int64)[::-1] * SIZE  # object i into slot N - 1 - i
        dst[:] = 0
        for layer in (2, 0):
            assert mover.read_same_host(get, by_node, dst, at + layer * LAYER, layer * LAYER,
                                        LAYER)
        got, want = dst.reshape(N, LAYERS, LAYER)[::-1], src.reshape(N, LAYERS, LAYER)
        assert np.array_equal(got[:, [0, 2]], want[:, [0, 2]])
        assert not got[:, [1, 3]].any()  # nothing else written
        assert mover.moved()["store_read/shm"] == 2 * N * LAYER

        off = RangeMover(transfer, cluster.tmp, use_shm=False)  # must take the engine
        assert not off.read_same_host(get, by_node, dst, at, 0, LAYER)
        with pytest.raises(ValueError, match="not within an object"):
            mover.read_same_host(get, by_node, dst, at, SIZE - 8, 16)
        with pytest.raises(TransferError, match="outside its memory"):
            mover.read_same_host(get, by_node, dst[:SIZE], at, 0, LAYER)
        late = GetPlan(get.size, get.keys, get.replicas, get.nodes, time.time() - 1)
        with pytest.raises(TransferError, match="lease"):
            mover.read_same_host(late, by_node, dst, at, 0, LAYER)
        absent = await c.plan_get(ks + keys(1), SIZE)
        assert absent.first_replicas() is None  # a key the store lacks: ``read`` says so
        for m in (mover, off):
            m.close()
        await c.close()

    asyncio.run(go())
