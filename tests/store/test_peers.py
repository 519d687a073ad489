"""SegmentMaps: one mapping per node, file and epoch; shared bytes; honest fallbacks; dead
nodes and replaced files unmapped."""
from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from typing import Iterator

import pytest

from common.host import host_id
from common.store.peers import SegmentMaps
from common.store.shm import Segment

NBYTES = 1 << 16


@pytest.fixture
def shm_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="crescent-peers-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def mappings_of(path: str) -> int:
    """How many mappings of ``path`` this process has (from /proc/self/maps)."""
    with open("/proc/self/maps") as fh:
        return sum(1 for line in fh if line.rstrip().split(" ")[-1] == path)


def seg_path(shm_dir: str, name: str) -> str:
    """A file named as store nodes name their segments (only those are mapped)."""
    return os.path.join(shm_dir, f"crescent-store-testhost-{name}-1")


def info(path: str, epoch: int, nbytes: int = NBYTES) -> dict:
    return {"shm_path": path, "segment_bytes": nbytes, "epoch": epoch, "host_id": host_id()}


def test_maps_once_per_epoch_and_sees_the_owners_bytes(shm_dir):
    path = seg_path(shm_dir, "a")
    owner = Segment(NBYTES, path, create=True)
    maps = SegmentMaps(shm_dir)
    try:
        ctypes.memmove(owner.base + 100, b"crescent", 8)
        seg = maps.get("a", info(path, 1))
        assert seg is not None and seg.base != owner.base
        assert ctypes.string_at(seg.base + 100, 8) == b"crescent"
        ctypes.memmove(seg.base + 200, b"back", 4)  # writes land in the owner's segment
        assert ctypes.string_at(owner.base + 200, 4) == b"back"
        assert maps.get("a", info(path, 1)) is seg  # cached for the same epoch
        again = maps.get("a", info(path, 2))  # the node re-registered: a fresh mapping
        assert again is not None and again is not seg
        assert maps.get("a", info(path, 2)) is again
        assert mappings_of(path) == 2  # the owner's and ours: the old one was closed
    finally:
        maps.close()
        owner.close(unlink=True)


def test_no_mapping_for_missing_unopenable_or_own_files(shm_dir):
    own = seg_path(shm_dir, "self")
    small = seg_path(shm_dir, "small")
    Segment(1024, small, create=True).close()
    maps = SegmentMaps(shm_dir, own_path=own)
    Segment(NBYTES, own, create=True).close()
    try:
        assert maps.get("a", {"segment_bytes": NBYTES, "epoch": 1}) is None  # no shm file
        assert maps.get("a", info("", 1)) is None
        assert maps.get("a", info(own, 1)) is None  # our own segment: never mapped twice
        missing = seg_path(shm_dir, "gone")
        assert maps.get("a", info(missing, 1)) is None
        assert maps.get("a", info(small, 1)) is None  # smaller than announced: refused
        assert maps.get("a", info(small, 1, nbytes=1024)) is None  # remembered for epoch 1
        assert maps.get("a", info(small, 2, nbytes=1024)) is not None  # a new epoch retries
    finally:
        maps.close()


def test_retain_unmaps_nodes_the_master_no_longer_lists(shm_dir):
    paths = {n: seg_path(shm_dir, n) for n in "abc"}
    owners = {n: Segment(NBYTES, path, create=True) for n, path in paths.items()}
    maps = SegmentMaps(shm_dir)
    try:
        for n, path in paths.items():
            assert maps.get(n, info(path, 1)) is not None
        assert maps.mapped() == paths
        assert [mappings_of(p) for p in paths.values()] == [2, 2, 2]
        assert maps.retain(["a", "c", "z"]) == ["b"]
        assert maps.mapped() == {"a": paths["a"], "c": paths["c"]}
        assert [mappings_of(p) for p in paths.values()] == [2, 1, 2]  # b unmapped here
        assert maps.retain([]) == ["a", "c"] and maps.mapped() == {}
        assert [mappings_of(p) for p in paths.values()] == [1, 1, 1]
        restarted = seg_path(shm_dir, "b2")  # b came back with a new file
        owner_b2 = Segment(NBYTES, restarted, create=True)
        assert maps.get("b", info(paths["b"], 1)) is not None
        assert maps.get("b", info(restarted, 1)) is not None
        assert mappings_of(paths["b"]) == 1 and mappings_of(restarted) == 2
        owner_b2.close(unlink=True)
    finally:
        maps.close()
        for owner in owners.values():
            owner.close(unlink=True)


def test_close_waits_for_a_pinned_copy(shm_dir):
    path = seg_path(shm_dir, "a")
    owner = Segment(NBYTES, path, create=True)
    maps = SegmentMaps(shm_dir)
    try:
        seg = maps.get("a", info(path, 1))
        assert seg is not None
        pin = seg.view(0, seg.nbytes)  # what a copy in flight holds
        assert maps.retain([]) == ["a"]
        assert mappings_of(path) == 2  # still mapped: the copy may still run
        ctypes.memmove(seg.base, b"late", 4)  # and its bytes are still there
        assert ctypes.string_at(owner.base, 4) == b"late"
        seg.close()  # a second close is harmless
        pin.release()
        del seg, pin
        assert mappings_of(path) == 1  # the last reference gone: unmapped
    finally:
        maps.close()
        owner.close(unlink=True)
