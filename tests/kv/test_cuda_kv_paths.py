"""GPU KV on one host (issue 26): the CUDA IPC handle a decode worker advertises, a prefill
worker writing through it from another process, and a store segment pinned for the GPU.

The handle's wire form is checked here on any machine; the rest needs a CUDA GPU (skipped
without one; ``benchmarks/gpu_device.sh`` runs it on a lent GPU machine)."""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from common.kv.cuda_ipc import IpcHandle, PeerKVCuda, export
from common.kv.memory import PagedKVMemory

gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                         reason="CUDA IPC and pinned memory need a CUDA GPU (none here)")


def test_a_handle_survives_its_wire_form() -> None:
    h = IpcHandle(1, b"\x00\x01ab", 1 << 30, 512, b"/torch_1_2", 8, b"", True, 4096, 1 << 20)
    assert IpcHandle.decode(h.encode()) == h


@pytest.mark.parametrize("text", ["", "1,2,3", "x,00,1,1,00,1,00,1,1,1", "1,zz,1,1,00,1,00,1,1,1"])
def test_a_malformed_handle_is_refused(text) -> None:
    with pytest.raises(ValueError):
        IpcHandle.decode(text)


def test_host_memory_exports_no_handle() -> None:
    assert export(PagedKVMemory(4, 2, 16, 2, 8)) is None


def _decode_side(conn) -> None:
    """Another process: GPU KV memory, its handle sent; answers with block contents."""
    kv = PagedKVMemory(8, 3, 16, 2, 64, torch.bfloat16, "cuda")
    conn.send(export(kv))
    for blocks in iter(conn.recv, None):
        torch.cuda.synchronize()
        conn.send([kv.data[b].float().cpu() for b in blocks])


@pytest.mark.gpu
@gpu
def test_a_prefill_writes_another_process_s_gpu_kv_layer_by_layer_and_whole() -> None:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(there,), daemon=True)
    proc.start()
    try:
        local = PagedKVMemory(6, 2, 16, 2, 64, torch.bfloat16, "cuda")
        local.data.normal_()
        # a stage holding layers 1-2 of a 3-layer model writes its window of the blocks
        peer = PeerKVCuda.open(here.recv(), local, first_layer=1, total_layers=3)
        assert peer.num_blocks == 8
        peer.write_layer([4, 0], [7, 2], 1)
        peer.write_blocks([3], [5])
        here.send([7, 2, 5])
        got = here.recv()
        assert torch.equal(got[0][2], local.data[4, 1].float().cpu())  # layer 1 → 2
        assert not got[0][:2].any()
        assert torch.equal(got[1][2], local.data[0, 1].float().cpu())
        assert torch.equal(got[2][1:], local.data[3].float().cpu())
        with pytest.raises(IndexError):
            peer.write_layer([0], [8], 0)  # outside the peer: refused, nothing launched
        peer.close()
    finally:
        here.send(None)
        proc.join(30)


def gpu_store(blocks: int, objects: int):
    """A GPU worker's KV memory (4 layers, bfloat16, random), a same-host store node's
    segment of ``objects`` blocks in /dev/shm (a disk file's pages do not pin) and the
    worker's mover: (its directory, kv, segment, node, mover)."""
    import tempfile

    from common.host import host_id
    from common.store.plans import NodeRef
    from common.store.ranges import RangeMover
    from common.store.shm import Segment, owned_path

    tmp_path = tempfile.mkdtemp(prefix="crescent-test-", dir="/dev/shm")
    kv = PagedKVMemory(blocks, 4, 16, 2, 64, torch.bfloat16, "cuda")
    kv.data.normal_()
    seg = Segment(objects * kv.block_nbytes, owned_path(tmp_path, "store", "g"), create=True)
    node = NodeRef("g", "nowhere:1", seg.base, seg.nbytes, seg.path, 1, "h", host_id())
    return tmp_path, kv, seg, node, RangeMover(None, tmp_path, device_memory=kv.device_bytes)


@pytest.mark.gpu
@gpu
def test_a_gpu_worker_s_store_bytes_go_through_the_pinned_segment() -> None:
    import shutil

    from common.store.plans import GetPlan, Location, PutPlan, Replicas

    tmp_path, kv, seg, node, mover = gpu_store(16, 32)
    obj = kv.block_nbytes
    keys = [f"{i:064x}" for i in range(20)]
    reps = [Replicas([Location("g", s * obj)]) for s in range(31, 11, -1)]  # scattered
    src = [3, 1, 7, 5, 0, 2, 4, 6]
    far = time.time() + 60
    mover.write(PutPlan(obj, keys[:8], list(range(8)), reps[:8], [node], far),
                [(i, kv.block_address(b), 0, obj) for i, b in enumerate(src)])
    want = kv.data[src].clone()
    dst = [8, 9, 10, 11, 12, 13, 14, 15]
    ln = kv.layer_nbytes
    for layer in range(4):  # layer by layer, as a layer-wise load reads
        mover.read(GetPlan(obj, keys[:8], reps[:8], [node], far),
                   [(i, kv.layer_address(b, layer), layer * ln, ln) for i, b in enumerate(dst)])
    torch.cuda.synchronize()
    assert torch.equal(kv.data[dst], want)
    assert set(mover.moved()) == {"store_write/pinned", "store_read/pinned"}
    mover.retain([])  # unpinned before unmapped
    mover.close()
    seg.close()
    shutil.rmtree(tmp_path)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("two_d", [True, False])
def test_reads_launched_per_layer_land_behind_their_events(two_d, monkeypatch) -> None:
    """A stored prefix's reads queued at once, a layer at a time (2D DMA into staging and a
    scatter, or the gather kernel where 2D copies are not usable): after waiting on layer
    l's event, the compute stream sees layer l; every byte lands; the lane confirms."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    from common.kv import dma2d
    from common.store.plans import GetPlan, Location, PutPlan, Replicas

    if two_d:
        assert dma2d.usable(torch.device("cuda")) is not None, "2D copies refused on this GPU"
    else:
        monkeypatch.setattr(dma2d, "usable", lambda device: None)
    tmp_path, kv, seg, node, mover = gpu_store(40, 64)
    obj = kv.block_nbytes
    slots = [10, 11, 12, 13, 40, 41, 3, 50, 52, 54]  # runs of one pitch, and strays
    keys = [f"{i:064x}" for i in range(len(slots))]
    reps = [Replicas([Location("g", s * obj)]) for s in slots]
    src = list(range(len(slots)))
    far = time.time() + 60
    mover.write(PutPlan(obj, keys, src, reps, [node], far),
                [(i, kv.block_address(b), 0, obj) for i, b in enumerate(src)])
    want = kv.data[src].clone()
    dst = [39, 20, 21, 22, 30, 25, 26, 27, 28, 15]
    lane = ThreadPoolExecutor(1)
    reads = mover.launch_reads(GetPlan(obj, keys, reps, [node], far), [b * 4 for b in dst],
                               0, kv.layer_nbytes, 4, lane)
    assert reads is not None and len(reads.events) == 4
    for layer in range(4):
        torch.cuda.current_stream().wait_event(reads.events[layer])
        assert torch.equal(kv.data[dst, layer].clone(), want[:, layer])
    assert reads.done.result(timeout=30) == len(slots) * obj
    assert mover.moved()["store_read/pinned"] == len(slots) * obj
    lane.shutdown()
    mover.retain([])
    mover.close()
    seg.close()
    shutil.rmtree(tmp_path)
