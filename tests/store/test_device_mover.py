"""RangeMover's GPU path (``device_memory``), run on host tensors: a same-host segment is
"pinned" once, pieces move through it by ``common/kv/rows.py``, the pinning is undone before
the mapping closes, and bytes outside the device memory never take that path.
(tests/kv/test_cuda_kv_paths.py runs the same on a GPU with real pinned memory.)"""
from __future__ import annotations

import time

import pytest
import torch

from common.host import host_id
from common.store.plans import GetPlan, Location, NodeRef, PutPlan, Replicas
from common.store.ranges import RangeMover
from common.store.shm import Segment, owned_path
from common.transfer import TransferError

OBJ = 256  # bytes per object: 4 "layers" of 64


class HostViews:
    """What PinnedSegment gives, without CUDA: the mapping as host tensors."""

    opened: list["HostViews"] = []

    def __init__(self, seg: Segment, device) -> None:
        self.host = self.device = torch.frombuffer(seg.view(0, seg.nbytes), dtype=torch.uint8)
        self.closed = False
        HostViews.opened.append(self)

    def close(self) -> None:
        self.host = self.device = torch.empty(0, dtype=torch.uint8)
        self.closed = True


def setup(tmp_path):
    seg = Segment(64 * OBJ, owned_path(str(tmp_path), "store", "n0"), create=True)
    node = NodeRef("n0", "nowhere:1", seg.base, seg.nbytes, seg.path, 1, "h", host_id())
    memory = torch.randint(0, 256, (32 * OBJ,), dtype=torch.uint8)
    mover = RangeMover(None, str(tmp_path), device_memory=memory)
    mover.device.pin_segment = HostViews
    return seg, node, memory, mover


def test_blocks_and_layers_go_through_the_pinned_segment_and_back(tmp_path) -> None:
    HostViews.opened.clear()
    seg, node, memory, mover = setup(tmp_path)
    base = memory.data_ptr()
    keys = [f"{i:064x}" for i in range(6)]
    slots = [40, 3, 17, 9, 60, 22]
    reps = [Replicas([Location("n0", s * OBJ)]) for s in slots]
    far = time.time() + 60
    put = PutPlan(OBJ, keys, list(range(6)), reps, [node], far)
    blocks = [5, 1, 30, 12, 7, 20]
    mover.write(put, [(i, base + b * OBJ, 0, OBJ) for i, b in enumerate(blocks)])
    stored = torch.frombuffer(seg.view(0, seg.nbytes), dtype=torch.uint8)
    for s, b in zip(slots, blocks):
        assert torch.equal(stored[s * OBJ:(s + 1) * OBJ], memory[b * OBJ:(b + 1) * OBJ])
    # read back layer by layer (64 bytes at each object's layer offset) into other blocks
    back = [2, 4, 6, 8, 10, 11]
    before = memory.clone()
    get = GetPlan(OBJ, keys, reps, [node], far)
    for layer in range(4):
        mover.read(get, [(i, base + b * OBJ + layer * 64, layer * 64, 64)
                         for i, b in enumerate(back)])
    for b, src in zip(back, blocks):
        assert torch.equal(memory[b * OBJ:(b + 1) * OBJ], before[src * OBJ:(src + 1) * OBJ])
    moved = mover.moved()
    assert moved == {"store_write/pinned": 6 * OBJ, "store_read/pinned": 6 * OBJ}
    assert len(HostViews.opened) == 1  # pinned once for every call
    mover.retain([])  # the node is gone: unpinned, then unmapped
    assert HostViews.opened[0].closed
    mover.close()
    seg.close()


def test_host_bytes_of_a_gpu_worker_take_the_host_path(tmp_path) -> None:
    """Pieces outside ``device_memory`` (a host buffer) are memmoved as before: never
    indexed as device memory, never pinned for."""
    HostViews.opened.clear()
    seg, node, memory, mover = setup(tmp_path)
    other = torch.randint(0, 256, (OBJ,), dtype=torch.uint8)
    put = PutPlan(OBJ, ["ab" * 32], [0], [Replicas([Location("n0", 5 * OBJ)])], [node],
                  time.time() + 60)
    assert mover.try_write(put, [(0, other.data_ptr(), 0, OBJ)]) == [True]
    stored = torch.frombuffer(seg.view(0, seg.nbytes), dtype=torch.uint8)
    assert torch.equal(stored[5 * OBJ:6 * OBJ], other)
    assert not HostViews.opened and mover.moved() == {"store_write/shm": OBJ}
    mover.close()
    seg.close()


def test_reads_launched_layer_by_layer_land_in_each_block(tmp_path) -> None:
    """``launch_reads`` queues a stored prefix's reads a layer at a time (what a GPU prefill
    does at admission; on host tensors they run at once, with no events): each local
    block gets its object's layers, the lane confirms them within the lease, bytes
    counted; a plan that cannot go this way gets None (the caller reads otherwise)."""
    from concurrent.futures import ThreadPoolExecutor

    HostViews.opened.clear()
    seg, node, memory, mover = setup(tmp_path)
    keys = [f"{i:064x}" for i in range(3)]
    slots = [50, 7, 33]
    reps = [Replicas([Location("n0", s * OBJ)]) for s in slots]
    stored = torch.frombuffer(seg.view(0, seg.nbytes), dtype=torch.uint8)
    stored[:] = torch.randint(0, 256, (seg.nbytes,), dtype=torch.uint8)
    get = GetPlan(OBJ, keys, reps, [node], time.time() + 60)
    blocks = [9, 2, 30]
    lane = ThreadPoolExecutor(1)
    reads = mover.launch_reads(get, [b * 4 for b in blocks], 0, 64, 4, lane)  # 4 rows a block
    assert reads is not None and reads.events == [None] * 4
    assert reads.done.result() == reads.nbytes == 3 * OBJ
    for s, b in zip(slots, blocks):
        assert torch.equal(memory[b * OBJ:(b + 1) * OBJ], stored[s * OBJ:(s + 1) * OBJ])
    assert mover.moved() == {"store_read/pinned": 3 * OBJ}
    # a pipeline stage's window: rows 2-3 of each object into a 2-row block
    before = memory.clone()
    assert mover.launch_reads(get, [0, 2, 4], 2, 64, 2, lane).done.result() == 3 * 128
    for i, s in enumerate(slots):
        assert torch.equal(memory[i * 128:(i + 1) * 128], stored[s * OBJ + 128:(s + 1) * OBJ])
    assert torch.equal(memory[3 * 128:], before[3 * 128:])
    # an absent key, an object not aligned to rows (a kernel's gather needs them), rows
    # past either memory: None
    absent = GetPlan(OBJ, keys[:1], [Replicas([])], [node], get.deadline)
    odd = GetPlan(OBJ, keys[:1], [Replicas([Location("n0", 32)])], [node], get.deadline)
    far = GetPlan(OBJ, keys[:1], [Replicas([Location("n0", 63 * OBJ)])], [node], get.deadline)
    assert mover.launch_reads(absent, [0], 0, 64, 4, lane) is None
    assert mover.launch_reads(odd, [0], 0, 64, 4, lane) is None
    assert mover.launch_reads(get, [31 * 4 + 1, 0, 0], 0, 64, 4, lane) is None
    assert mover.launch_reads(far, [0], 0, 64, 5, lane) is None
    # landed past the lease: the lane says so, nothing more counted
    with pytest.raises(TransferError, match="past the lease"):
        mover.device._landed(reads, time.time() - 1)
    assert mover.moved() == {"store_read/pinned": 3 * OBJ + 3 * 128}
    lane.shutdown()
    mover.close()
    seg.close()


def test_a_launch_that_fails_midway_poisons_the_part(tmp_path) -> None:
    """Reads whose launch failed after some layers: the lane fails them once the queued
    ones are done, and a step that reaches a layer never queued is poisoned at once (no
    event to wait for), naming the failure, so the prompt is computed instead."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from services.prefill.layer_io import LaunchedLoads, PartIO, StepIO

    HostViews.opened.clear()
    seg, node, memory, mover = setup(tmp_path)
    keys = [f"{i:064x}" for i in range(2)]
    get = GetPlan(OBJ, keys, [Replicas([Location("n0", s * OBJ)]) for s in (4, 9)], [node],
                  time.time() + 60)
    lane = ThreadPoolExecutor(1)
    layers = iter(range(10))
    real = torch.Tensor.index_copy_  # the gather path's scatter: fail at the third layer

    def flaky(self, *args):
        if next(layers) == 2:
            raise RuntimeError("launch failed")
        return real(self, *args)
    torch.Tensor.index_copy_ = flaky
    try:
        reads = mover.launch_reads(get, [0, 4], 0, 64, 4, lane)
    finally:
        torch.Tensor.index_copy_ = real
    assert len(reads.events) == 2
    with pytest.raises(TransferError, match="launch failed"):
        reads.done.result()
    loads = LaunchedLoads(reads, 2 * OBJ)
    stream = SimpleNamespace(chunked=False, aborted=True)  # streams nothing
    part = PartIO(stream, 0, 8, loads, (0, 8))  # type: ignore[arg-type]
    io = StepIO([part], SimpleNamespace(num_layers=4), 0, None, None)  # type: ignore
    for layer in range(4):
        io.before(layer)
    assert part.poisoned and "layer 2 was not queued" in loads.failed
    assert not asyncio.run(loads.landed())
    lane.shutdown()
    mover.close()
    seg.close()
