"""Byte ranges of store objects: the mover that copies them under a plan.

A store object is one KV block of the whole model (``num_layers`` slices of
``layer_nbytes``); a pipeline stage holding layers [a, b) writes or reads bytes
[a * layer_nbytes, b * layer_nbytes) of each object, a layer-wise writer one layer at a time.
So the verbs here move byte ranges *within* objects, from several processes:

- One process asks the master (``StoreClient.start_put`` / ``plan_get``) and gets a plan
  (common/store/plans.py), which rides inside other messages to the processes that copy.
- Each process copies its pieces with its own ``RangeMover``: ``memmove``s where the
  node's segment file is mappable here (same host; a whole layer of a prompt's prefix in
  numpy's loops, ``read_same_host``), else one transfer-engine call per node.
  A mover of KV in GPU memory (``device_memory``) registers a same-host segment as pinned
  memory instead and copies by DMA or by a gather and a scatter kernel
  (``common/store/pinned.py``, ``common/kv/rows.py``).
- The asker commits (``StoreClient.end_put``) only what every writer reported written:
  a reader never sees a half-written object.

Deadlines are wall clock (``time.time()``): they cross processes. A write that ends after
``PutPlan.deadline`` is a failure (the master may have reclaimed the space); a read that ends
after ``GetPlan.deadline`` (its lease) is one too (the bytes may have been overwritten).
A transfer-engine call abandoned at its deadline may still land later (``TransferAgent.
in_flight``): the caller must not reuse its local memory before that call is done.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import numpy as np

from common.store.peers import SegmentMaps
from common.store.plans import GetPlan, Location, NodeRef, PutPlan
from common.store.shm import copy_many, copy_rows
from common.transfer import TransferAgent, TransferError
from common.worker_metrics import current as metrics

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# (key position in the plan, local address, offset within the object, nbytes)
Item = tuple[int, int, int, int]
_SPLIT_BYTES = 1 << 20  # a same-host copy this large is split over the mover's threads


# One node's share of a call: (item position, local address, offset in the segment, nbytes).
_Piece = tuple[int, int, int, int]


class RangeMover:
    """Copies byte ranges of store objects between this process's registered memory and
    node segments. One per process; its methods are synchronous and thread-safe, meant
    for a worker's copy thread (never the event loop). ``use_shm=False`` forces the
    transfer engine even where a segment file could be mapped."""

    def __init__(self, transfer: Optional[TransferAgent], shm_dir: Optional[str], *,
                 use_shm: bool = True, threads: int = 2,
                 device_memory: Optional["torch.Tensor"] = None) -> None:
        self.transfer = transfer
        self.use_shm = use_shm
        self.errors = 0  # failed node batches (transfer errors, deadlines, unknown nodes)
        self._moved: dict[str, int] = {}  # bytes copied, by verb and path (``moved``)
        self.device: Any = None  # KV on a GPU: same-host segments pinned, copied by the GPU
        if device_memory is not None:
            from common.store.pinned import DeviceCopies  # torch: only a GPU worker's mover

            self.device = DeviceCopies(device_memory, self._count, self._failed)
        self._maps = SegmentMaps(shm_dir, on_close=self.device.unpin if self.device else None)
        self._lock = threading.Lock()  # the maps and the counter
        self._threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="store-range")

    # ------------------------------------------------------------------ verbs
    def write(self, plan: PutPlan, items: Sequence[Item]) -> None:
        """Write every item to every replica of its key; raises ``TransferError`` unless
        all landed by ``plan.deadline``."""
        _raise_unless(self.try_write(plan, items), "write", plan.deadline)

    def read(self, plan: GetPlan, items: Sequence[Item]) -> None:
        """Read every item from the first replica of its key that works; raises
        ``TransferError`` on an absent key, a failure, or a lease over before the end."""
        _raise_unless(self.try_read(plan, items), "read", plan.deadline)

    def read_same_host(self, plan: GetPlan, first: dict[str, tuple[np.ndarray, np.ndarray]],
                       local: np.ndarray, local_offsets: np.ndarray, offset: int,
                       nbytes: int) -> bool:
        """``read`` of bytes [offset, offset + nbytes) of every key into ``local`` (a flat
        uint8 view of this process's memory) at ``local_offsets`` (per key), in numpy's
        loops (``copy_rows``), where every key's first replica (``first``:
        ``plan.first_replicas()``) is in a segment mapped here; False where one is not
        (nothing copied: ``read`` it). ``TransferError`` past the lease."""
        if offset < 0 or nbytes <= 0 or offset + nbytes > plan.size:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is not within an object "
                             f"of {plan.size} bytes")
        if not self.use_shm or self.device is not None:
            return False
        self.retain(plan.live)
        refs = {n.node_id: n for n in plan.nodes}
        segments = []
        for node_id, (keys, offsets) in first.items():
            pinned = self._pin(refs[node_id]) if node_id in refs else None
            if pinned is None:
                return False
            segments.append((np.frombuffer(pinned[1], dtype=np.uint8), keys, offsets))
        if time.time() >= plan.deadline:
            raise TransferError("store read: the lease ended before the copy")
        try:
            for segment, keys, offsets in segments:
                copy_rows(local, local_offsets[keys], segment, offsets + offset, nbytes)
        except IndexError as exc:
            self._failed("shm", f"a range outside its memory ({exc})")
            raise TransferError(f"store read: a range outside its memory ({exc})") from exc
        self._count(False, "shm", len(local_offsets) * nbytes)
        if time.time() > plan.deadline:
            raise TransferError("store read: past the deadline (the lease)")
        return True

    def try_write(self, plan: PutPlan, items: Sequence[Item]) -> list[bool]:
        """Per item: True where every replica was written by the deadline."""
        _check_items(plan.size, len(plan.keys), items)
        self.retain(plan.live)
        jobs = [(i, loc) for i, item in enumerate(items)
                for loc in plan.replicas[item[0]].locations]
        done = self._move(plan.nodes, items, jobs, True, plan.deadline)
        ok = [True] * len(items)
        for (i, _), d in zip(jobs, done):
            ok[i] = ok[i] and d
        return ok

    def try_read(self, plan: GetPlan, items: Sequence[Item]) -> list[bool]:
        """Per item: True where copied from some replica, the whole call within the lease."""
        _check_items(plan.size, len(plan.keys), items)
        self.retain(plan.live)
        ok = [False] * len(items)
        attempt = 0
        while True:  # replica ``attempt`` of every item not copied yet
            jobs = [(i, plan.replicas[item[0]].locations[attempt])
                    for i, item in enumerate(items)
                    if not ok[i] and attempt < len(plan.replicas[item[0]].locations)]
            if not jobs:
                break
            for (i, _), d in zip(jobs, self._move(plan.nodes, items, jobs, False,
                                                  plan.deadline)):
                ok[i] = d
            attempt += 1
        if time.time() > plan.deadline:  # the lease lapsed mid-copy: trust nothing
            return [False] * len(items)
        return ok

    # ------------------------------------------------------------- mappings
    def retain(self, live: Optional[Iterable[str]]) -> None:
        """Unmap the segments of nodes not in ``live`` (the master's node list)."""
        if live is not None:
            with self._lock:
                self._maps.retain(live)

    def mapped(self) -> dict[str, str]:
        with self._lock:
            return self._maps.mapped()

    def close(self) -> None:
        """Never blocks: a copy still running keeps its mapping pinned until it ends."""
        self._pool.shutdown(wait=False)
        with self._lock:
            self._maps.close()

    # ------------------------------------------------------------ data path
    def _move(self, nodes: list[NodeRef], items: Sequence[Item],
              jobs: list[tuple[int, Location]], write: bool, deadline: float) -> list[bool]:
        """Each job (item, location) copied? One batch per node, the nodes in parallel;
        all False once past ``deadline``."""
        if time.time() >= deadline:
            return [False] * len(jobs)
        refs = {n.node_id: n for n in nodes}
        groups: dict[str, list[int]] = {}
        for j, (_, loc) in enumerate(jobs):
            groups.setdefault(loc.node_id, []).append(j)
        tasks: list[tuple[str, Callable[[], bool]]] = []
        failed: set[str] = set()
        for node_id, js in groups.items():
            pieces = [(i, items[i][1], loc.offset + items[i][2], items[i][3])
                      for i, loc in (jobs[j] for j in js)]
            calls = self._tasks(refs.get(node_id), node_id, pieces, write, deadline)
            tasks += [(node_id, call) for call in calls]
            if not calls:
                failed.add(node_id)
        if len(tasks) == 1:
            results = [tasks[0][1]()]
        else:
            results = [f.result() for f in [self._pool.submit(t) for _, t in tasks]]
        failed.update(n for (n, _), r in zip(tasks, results) if not r)
        if time.time() > deadline:
            return [False] * len(jobs)
        return [loc.node_id not in failed for _, loc in jobs]

    def _tasks(self, node: Optional[NodeRef], node_id: str, pieces: list[_Piece],
               write: bool, deadline: float) -> list[Callable[[], bool]]:
        """The calls that move ``pieces`` to or from the node (none: it cannot be reached):
        memmoves through its segment mapped here (split over the threads when large), for
        GPU memory one GPU copy through it registered as pinned memory, or one
        transfer-engine call."""
        if node is None:
            self._failed(node_id, "node not in the plan")
            return []
        if self.device is not None and self.device.covers(pieces):
            seg = self._pinned_segment(node)
            if seg is not None:
                return [lambda: self.device.copy(node_id, seg, pieces, write)]
            pinned = None
        else:
            pinned = self._pin(node)
        if pinned is not None:
            base, pin = pinned
            if any(off + n > len(pin) for _, _, off, n in pieces):
                self._failed(node_id, "a location is beyond its segment")
                return []
            pairs = [(base + off, addr, n) if write else (addr, base + off, n)
                     for _, addr, off, n in pieces]
            k = self._threads if sum(n for *_, n in pieces) >= _SPLIT_BYTES else 1
            return [lambda part=pairs[j::k]: self._memmove(part, pin, write)
                    for j in range(min(k, len(pairs)))]
        if self.transfer is None:
            self._failed(node_id, "not mappable here and no transfer engine")
            return []
        return [lambda: self._transfer(node, pieces, write, deadline)]

    def _transfer(self, node: NodeRef, pieces: list[_Piece], write: bool,
                  deadline: float) -> bool:
        assert self.transfer is not None
        remaining = deadline - time.time()
        if remaining <= 0:
            return False
        move = self.transfer.write if write else self.transfer.read
        try:
            move(node.session_id, [addr for _, addr, _, _ in pieces],
                 [node.base + off for _, _, off, _ in pieces], [n for *_, n in pieces],
                 timeout=remaining)
            self._count(write, "transfer_engine", sum(n for *_, n in pieces))
            return True
        except (TransferError, OSError) as exc:
            self._failed(node.session_id, str(exc))
            return False

    def _pin(self, node: NodeRef) -> Optional[tuple[int, memoryview]]:
        """The node's segment mapped here: its address and a view that keeps the mapping
        alive under the copy; None: use the transfer engine."""
        if not self.use_shm:
            return None
        with self._lock:
            seg = self._maps.get(node.node_id, node.info())
            return (seg.base, seg.view(0, seg.nbytes)) if seg is not None else None

    # ------------------------------------------------------ GPU KV (common/store/pinned.py)
    def launch_reads(self, plan: GetPlan, local_rows: Sequence[int], first_row: int,
                     row_nbytes: int, layers: int, waiter: ThreadPoolExecutor) -> Any:
        """A GPU mover's reads of ``plan`` queued a row (a layer of every object) at a
        time, from same-host pinned segments (``DeviceCopies.launch_reads``); None where
        they cannot go that way: ``read`` then."""
        if self.device is None or time.time() >= plan.deadline:
            return None
        self.retain(plan.live)
        refs = {n.node_id: n for n in plan.nodes}
        return self.device.launch_reads(
            plan, lambda node_id: self._pinned_segment(refs[node_id]) if node_id in refs
            else None, local_rows, first_row, row_nbytes, layers, waiter)

    def _pinned_segment(self, node: NodeRef) -> Any:
        """The node's segment mapped here and registered as pinned memory; None: use the
        transfer engine (another host, or CUDA would not register it)."""
        assert self.device is not None
        if not self.use_shm:
            return None
        with self._lock:
            seg = self._maps.get(node.node_id, node.info())
            return self.device.pinned(seg, node.node_id) if seg is not None else None

    def _memmove(self, pairs: list[tuple[int, int, int]], pin: memoryview,
                 write: bool) -> bool:
        copy_many(pairs, pin)
        self._count(write, "shm", sum(n for *_, n in pairs))
        return True

    def _count(self, write: bool, path: str, nbytes: int) -> None:
        flow = f"store_{'write' if write else 'read'}"
        with self._lock:
            self._moved[f"{flow}/{path}"] = self._moved.get(f"{flow}/{path}", 0) + nbytes
        metrics().moved(flow, path, nbytes)

    def moved(self) -> dict[str, int]:
        """Bytes copied so far by ``store_read/PATH`` and ``store_write/PATH``, PATH "shm",
        "pinned" or "transfer_engine": which path the store's bytes took (worker heartbeats)."""
        with self._lock:
            return dict(self._moved)

    def _failed(self, where: str, why: str) -> None:
        with self._lock:
            self.errors += 1
        metrics().error("store", "range_copy")
        log.warning("store range copy via %s failed: %s", where, why)


def _check_items(size: int, nkeys: int, items: Sequence[Item]) -> None:
    for pos, _, offset, nbytes in items:
        if not 0 <= pos < nkeys:
            raise ValueError(f"key position {pos} is not in the plan's {nkeys} keys")
        if offset < 0 or nbytes <= 0 or offset + nbytes > size:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is not within an object "
                             f"of {size} bytes")


def _raise_unless(ok: list[bool], verb: str, deadline: float) -> None:
    if not all(ok):
        late = " (past the deadline)" if time.time() > deadline else ""
        raise TransferError(f"store {verb}: {ok.count(False)} of {len(ok)} ranges "
                            f"failed{late}")
