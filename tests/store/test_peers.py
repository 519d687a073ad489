"""SegmentMaps: one mapping per segment file and epoch, shared bytes, honest fallbacks."""
from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from typing import Iterator

import pytest

from common.store.peers import SegmentMaps
from common.store.shm import Segment

NBYTES = 1 << 16


@pytest.fixture
def shm_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="crescent-peers-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def info(path: str, epoch: int, nbytes: int = NBYTES) -> dict:
    return {"shm_path": path, "segment_bytes": nbytes, "epoch": epoch}


def test_maps_once_per_epoch_and_sees_the_owners_bytes(shm_dir):
    path = os.path.join(shm_dir, "node-a")
    owner = Segment(NBYTES, path, create=True)
    maps = SegmentMaps()
    try:
        ctypes.memmove(owner.base + 100, b"crescent", 8)
        seg = maps.get(info(path, 1))
        assert seg is not None and seg.base != owner.base
        assert ctypes.string_at(seg.base + 100, 8) == b"crescent"
        ctypes.memmove(seg.base + 200, b"back", 4)  # writes land in the owner's segment
        assert ctypes.string_at(owner.base + 200, 4) == b"back"
        assert maps.get(info(path, 1)) is seg  # cached for the same epoch
        again = maps.get(info(path, 2))  # the node re-registered: a fresh mapping
        assert again is not None and again is not seg
        assert maps.get(info(path, 2)) is again
    finally:
        maps.close()
        owner.close(unlink=True)


def test_no_mapping_for_missing_unopenable_or_own_files(shm_dir):
    own = os.path.join(shm_dir, "self")
    small = os.path.join(shm_dir, "small")
    Segment(1024, small, create=True).close()
    maps = SegmentMaps(own_path=own)
    Segment(NBYTES, own, create=True).close()
    try:
        assert maps.get({"segment_bytes": NBYTES, "epoch": 1}) is None  # no shm file
        assert maps.get(info("", 1)) is None
        assert maps.get(info(own, 1)) is None  # our own segment: never mapped twice
        missing = os.path.join(shm_dir, "gone")
        assert maps.get(info(missing, 1)) is None
        assert maps.get(info(small, 1)) is None  # smaller than announced: refused
        assert maps.get(info(small, 1, nbytes=1024)) is None  # remembered for epoch 1
        assert maps.get(info(small, 2, nbytes=1024)) is not None  # a new epoch retries
    finally:
        maps.close()
