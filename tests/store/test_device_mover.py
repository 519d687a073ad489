"""RangeMover's GPU path (``device_memory``), run on host tensors: a same-host segment is
"pinned" once, pieces move through it by ``common/kv/rows.py``, the pinning is undone before
the mapping closes, and bytes outside the device memory never take that path.
(tests/kv/test_cuda_kv_paths.py runs the same on a GPU with real pinned memory.)"""
from __future__ import annotations

import time

import torch

from common.host import host_id
from common.store.ranges import GetPlan, Location, NodeRef, PutPlan, RangeMover, Replicas
from common.store.shm import Segment, owned_path

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


def test_rows_launched_layer_by_layer_land_in_each_object(tmp_path) -> None:
    """``device_rows`` once per put, ``launch_write`` per layer (what a GPU prefill does
    from its compute thread): each object gets its block's layers, bytes counted."""
    from concurrent.futures import ThreadPoolExecutor

    HostViews.opened.clear()
    seg, node, memory, mover = setup(tmp_path)
    keys = [f"{i:064x}" for i in range(3)]
    slots = [50, 7, 33]
    reps = [Replicas([Location("n0", s * OBJ)]) for s in slots]
    put = PutPlan(OBJ, keys, [0, 1, 2], reps, [node], time.time() + 60)
    blocks = [9, 2, 30]
    rows = mover.device_rows(put, [b * 4 for b in blocks], 0, 64, 4)  # 4 rows of 64 a block
    assert rows is not None
    lane = ThreadPoolExecutor(1)
    futures = [mover.device.launch_write(rows, layer, put.deadline, lane) for layer in range(4)]
    assert [f.result() for f in futures] == [3 * 64] * 4
    stored = torch.frombuffer(seg.view(0, seg.nbytes), dtype=torch.uint8)
    for s, b in zip(slots, blocks):
        assert torch.equal(stored[s * OBJ:(s + 1) * OBJ], memory[b * OBJ:(b + 1) * OBJ])
    assert mover.moved() == {"store_write/pinned": 3 * OBJ}
    # an object not aligned to rows, or rows past either memory: the lane's way instead
    odd = PutPlan(OBJ, keys[:1], [0], [Replicas([Location("n0", 32)])], [node], put.deadline)
    assert mover.device_rows(odd, [0], 0, 64, 4) is None
    assert mover.device_rows(put, [b * 4 for b in blocks], 0, 64, 5) is not None
    assert mover.device_rows(put, [31 * 4 + 1, 0, 0], 0, 64, 4) is None
    lane.shutdown()
    mover.close()
    seg.close()
