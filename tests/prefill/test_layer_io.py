"""A stage's layer-wise KV I/O (services/prefill/layer_io.py, store_writes.py) against a
real store master and node: a stage holding layers [2, 4) of a 4-layer model loads its
layers of stored blocks layer by layer, streams them into its window of the decode
worker's blocks, and writes its layers of new objects, which are committed only where
every stage wrote them. A load that misses its lease poisons the part: nothing more is
streamed or stored for it."""
from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from common.kv.cuda_ipc import PeerKVCuda
from common.kv.memory import PagedKVMemory
from common.kv.shm_kv import PeerKV
from services.prefill.stage_protocol import StageStored
from common.store.ranges import RangeMover
from services.prefill.layer_io import LayerLoads, PartIO, StepIO, settle
from services.prefill.store_writes import StoreWrites, blocks_completed
from services.prefill.streaming import KVStream
from tests.store.conftest import client_for, cluster, keys, transfer  # noqa: F401 (fixtures)

LAYERS, BS = 4, 16
DIMS = dict(block_size=BS, num_kv_heads=2, head_dim=32)


def full_memory(num_blocks: int, seed: int) -> PagedKVMemory:
    kv = PagedKVMemory(num_blocks, LAYERS, **DIMS)
    kv.data.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(seed)))
    return kv


def test_blocks_completed_by_a_chunk() -> None:
    put = range(0, 100)
    assert blocks_completed(0, 48, 16, put) == range(0, 3)  # tokens 0-47: blocks 0, 1, 2
    assert blocks_completed(40, 70, 16, put) == range(2, 4)  # 47 ends block 2, 63 block 3
    assert blocks_completed(40, 47, 16, put) == range(2, 2)  # block 2 still one short
    assert blocks_completed(0, 64, 16, range(1, 3)) == range(1, 3)  # only those to put
    assert blocks_completed(0, 64, 16, range(5, 9)) == range(5, 4)  # empty


def test_a_stage_loads_streams_and_stores_its_layers(cluster, transfer, tmp_path) -> None:
    address = cluster.master()
    cluster.node("a")
    source = full_memory(4, seed=1)  # the KV another worker computed and stored
    stage = PagedKVMemory(4, 2, **DIMS)  # this stage: layers 2 and 3 of every block
    transfer.register(source.base_address, source.nbytes)
    transfer.register(stage.base_address, stage.nbytes)
    decode = PagedKVMemory(6, LAYERS, **DIMS, shm_path=f"/dev/shm/crescent-kv-test-lio-"
                                                       f"{os.getpid()}")
    peer = PeerKV(decode.shm_path, stage, first_layer=2, total_layers=LAYERS)
    lanes = [ThreadPoolExecutor(1) for _ in range(3)]

    async def go() -> None:
        c = await client_for(address, transfer, use_shm=True, shm_dir=cluster.tmp)
        mover = RangeMover(transfer, cluster.tmp)
        stored = keys(2)
        size = source.block_nbytes
        assert await c.batch_put_from(stored, [source.block_address(b) for b in (0, 1)],
                                      size) == 2
        plan = await c.plan_get(stored, size)
        assert plan is not None and plan.present() == [True, True]
        # blocks 0-1 load from the store, 2 is computed here; decode reserved 3, 4, 5
        loads = LayerLoads(mover, plan, stage, [0, 1], 2, lanes[0])
        stream = KVStream(transfer, lanes[1], stage, [0, 1, 2], [3, 4, 5], "", 0, peer,
                          first_layer=2, total_layers=LAYERS)
        new = keys(1)
        put = await StoreWrites(c, 0, BS, size).plan(new, size)
        part = PartIO(stream, 2 * BS, 3 * BS, loads, (0, 2 * BS), put, [2], [2])
        io = StepIO([part], stage, 2, mover, lanes[2])
        for layer in range(2):  # what Engine.stage_step does around each layer
            io.before(layer)
            stage.data[2, layer] = source.data[2, 2 + layer]  # "compute" block 2
            io.after(layer)
        assert not part.poisoned and loads.failed is None
        # what PrefillDone reports: our 2 layers of 2 blocks, first read to last
        assert loads.nbytes == 2 * 2 * stage.layer_nbytes and loads.read_s > 0
        await stream.wait(10)
        await settle(part.put_futures)
        assert torch.equal(stage.data[:2], source.data[:2, 2:])  # loaded: our layers only
        assert torch.equal(decode.data[3:6, 2:], source.data[:3, 2:])  # our window
        assert not decode.data[3:6, :2].any()  # the other stage's layers untouched

        # the head commits an object only where every stage wrote it
        writes = StoreWrites(c, 1, BS, size)
        writes.step_done(7, [part])
        assert await c.batch_exists(new) == [False]  # written by us, not yet committed
        writes.on_stored(StageStored(0, 0, 7, [True]))
        await asyncio.gather(*writes.tasks)
        assert writes.committed == 1 and await c.batch_exists(new) == [True]
        got = PagedKVMemory(1, LAYERS, **DIMS)
        transfer.register(got.base_address, got.nbytes)
        assert await c.batch_get_into(new, [got.block_address(0)], size) == [True]
        assert torch.equal(got.data[0, 2:], source.data[2, 2:])  # our layers in the object

        # a load past its lease poisons the part: no more streaming, no store writes
        late = await c.plan_get(stored, size)
        late = type(late)(late.size, late.keys, late.replicas, late.nodes, time.time() - 1)
        stream2 = KVStream(transfer, lanes[1], stage, [0, 1, 2], [3, 4, 5], "", 0, peer,
                           first_layer=2, total_layers=LAYERS)
        put2 = await StoreWrites(c, 0, BS, size).plan(keys(1), size)
        part2 = PartIO(stream2, 2 * BS, 3 * BS, LayerLoads(mover, late, stage, [0, 1], 2,
                                                            lanes[0]), (0, 2 * BS), put2, [2])
        io2 = StepIO([part2], stage, 2, mover, lanes[2])
        for layer in range(2):
            io2.before(layer)
            io2.after(layer)
        assert part2.poisoned and "layer 0" in part2.loads.failed
        assert stream2.bytes == 0 and part2.put_futures == []
        assert part2.written() == [False]

        # a chunked stream (a GPU peer through CUDA IPC; host memory here): the loaded
        # blocks go under the stage's last layer, the computed one after it, every layer
        # of each in one launch; the same bytes land in the window
        target = PagedKVMemory(6, LAYERS, **DIMS)
        gpu_peer = PeerKVCuda(target.data.view(-1).view(torch.uint8), stage, 2, LAYERS)
        launched = []
        gpu_peer.launch = lambda *a, launch=gpu_peer.launch: (
            launched.append(a[0].numel()) or launch(*a))
        stream3 = KVStream(transfer, lanes[1], stage, [0, 1, 2], [3, 4, 5], "", 0, gpu_peer,
                           first_layer=2, total_layers=LAYERS)
        stream3.send_prefix(0, 2)
        part3 = PartIO(stream3, 2 * BS, 3 * BS, LayerLoads(mover, plan, stage, [0, 1], 2,
                                                            lanes[0]), (0, 2 * BS))
        io3 = StepIO([part3], stage, 2, mover, lanes[2])
        for layer in range(2):
            io3.before(layer)
            io3.after(layer)
        await stream3.wait(10)
        assert launched == [2, 1] and stream3.sent == 3  # the chunk ended on a block edge
        assert torch.equal(target.data[3:6, 2:], decode.data[3:6, 2:])
        assert not target.data[3:6, :2].any()

        # GPU KV writes a chunk's objects whole after it (called directly here: this host
        # memory would go per layer); a prompt's last chunk waits for its first token
        hold = threading.Event()
        new4 = keys(1)
        put4 = await StoreWrites(c, 0, BS, size).plan(new4, size)
        part4 = PartIO(stream, 2 * BS, 3 * BS, put=put4, put_local=[2], hold_puts=hold)
        held = io._store_chunk(part4)
        await asyncio.sleep(0.05)
        assert not held.done()
        hold.set()
        await asyncio.wrap_future(held)
        assert await c.end_put(put4, [True]) == 1
        assert await c.batch_get_into(new4, [got.block_address(0)], size) == [True]
        assert torch.equal(got.data[0, 2:], stage.data[2])  # our layers of the object
        transfer.unregister(got.base_address)
        mover.close()
        await c.close()

    try:
        asyncio.run(go())
    finally:
        for lane in lanes:
            lane.shutdown()
        for kv in (source, stage):
            transfer.unregister(kv.base_address)
        peer.close()
        decode.close()


def prompt(tokens: int, fence: int) -> SimpleNamespace:
    """What StoreWrites reads of a prefill job: its fence, keys, progress, blocks."""
    return SimpleNamespace(task=SimpleNamespace(token_ids=range(tokens), fence=fence),
                           keys=keys(tokens // BS), done=0, aborted=False, failed=None,
                           remaining=tokens, plan=SimpleNamespace(
                               stored_from=0, block_table=list(range(tokens // BS))))


def test_grants_asked_a_step_ahead(cluster, transfer) -> None:
    """The next step's grants are asked while this one computes: a chunk that goes as
    predicted takes its grant without a round trip to the master; one that does not gives
    the grant back unwritten at once, so its objects can be put again."""
    address = cluster.master()
    cluster.node("a")

    async def go() -> None:
        c = await client_for(address, transfer, use_shm=True, shm_dir=cluster.tmp)
        writes = StoreWrites(c, 0, BS, 4096)
        a, b = prompt(4 * BS, fence=1), prompt(4 * BS, fence=2)
        writes.ask_ahead([a, b], 2 * BS, [(a, 2 * BS)])  # next: a's blocks 2-3
        assert list(writes.ahead) == [1] and writes.ahead[1][0] == range(2, 4)
        a.done = 2 * BS
        # the grant arrives while the step computes
        await asyncio.wait_for(asyncio.shield(writes.ahead[1][1]), 5)
        calls = c.stats.put_skipped + c.stats.put_failed + c.stats.puts
        part = PartIO(None, 2 * BS, 4 * BS)
        asked_now: list[object] = []
        ask = writes.plan
        writes.plan = lambda *args: asked_now.append(args) or ask(*args)  # type: ignore
        await writes.grant_part(a, part)
        assert asked_now == []  # no round trip: it was there
        assert part.put is not None and part.put.keys == [k.hex() for k in a.keys[2:4]]
        assert part.put_blocks == [2, 3] and part.put_local == [2, 3]
        assert c.stats.put_skipped + c.stats.put_failed + c.stats.puts == calls

        writes.ask_ahead([b], 2 * BS, [])  # predicted: b's blocks 0-1
        part = PartIO(None, 0, BS)  # but b computes one block only (not as predicted)
        await writes.grant_part(b, part)
        assert part.put is not None and part.put.keys == [b.keys[0].hex()]
        # the unused grant (blocks 0-1) was given back unwritten before grant_part returned
        again = await c.start_put([b.keys[1]], 4096)
        assert again is not None and again.keys == [b.keys[1].hex()]  # free to put again

        writes.ask_ahead([b], 2 * BS, [])
        writes.ask_ahead([], 2 * BS, [])  # b left (failed, aborted): its grant goes back
        assert writes.ahead == {}
        await writes.close()
        await c.close()

    asyncio.run(go())
