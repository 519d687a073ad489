"""Peer-named shared-memory files are mapped only when they are ours (common/security.py
``checked_shm_path``): a regular file of this user, directly in the configured directory,
named as Crescent names its segments. A store node info or a decode worker naming
``/etc/passwd``, a symlink, a path outside the directory or another name is refused and
logged, and the caller falls back to the transfer engine."""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import tempfile
from typing import Iterator

import pytest

from common.host import host_id
from common.kv.memory import PagedKVMemory
from common.kv.shm_kv import PeerKVMaps
from common.security import KV_SEGMENT, STORE_SEGMENT, checked_shm_path
from common.store.peers import SegmentMaps
from common.store.shm import Segment

NBYTES = 1 << 16
STORE_NAME = "crescent-store-host1-store_node-0-4242"
KV_NAME = "crescent-kv-host1-decode-0-4242"


@pytest.fixture
def shm_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="crescent-paths-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store_file(shm_dir: str) -> Iterator[Segment]:
    owner = Segment(NBYTES, os.path.join(shm_dir, STORE_NAME), create=True)
    yield owner
    owner.close(unlink=True)


def test_checked_shm_path_accepts_only_our_segment_files(shm_dir: str,
                                                         store_file: Segment) -> None:
    good = store_file.path
    assert checked_shm_path(good, shm_dir, STORE_SEGMENT) == good
    link = os.path.join(shm_dir, "crescent-store-host1-evil-1")
    os.symlink(good, link)
    os.mkdir(os.path.join(shm_dir, "crescent-store-host1-dir-1"))
    os.mkfifo(os.path.join(shm_dir, "crescent-store-host1-fifo-1"))
    refused = {
        "/etc/passwd": "not directly in",
        link: "not a regular file",
        os.path.join(shm_dir, "crescent-store-host1-dir-1"): "not a regular file",
        os.path.join(shm_dir, "crescent-store-host1-fifo-1"): "not a regular file",
        os.path.join(shm_dir, "crescent-store-host1-missing-1"): "No such file",
        os.path.join(shm_dir, "sub", "..", STORE_NAME): "not directly in",
        os.path.join(shm_dir, KV_NAME): "not a Crescent segment name",
        os.path.join(shm_dir, "crescent-store-a/b-1"): "not directly in",
        STORE_NAME: "not an absolute path",
    }
    for path, why in refused.items():
        with pytest.raises(ValueError, match=why):
            checked_shm_path(path, shm_dir, STORE_SEGMENT)
    with pytest.raises(ValueError, match="no shared-memory directory"):
        checked_shm_path(good, None, STORE_SEGMENT)
    assert KV_SEGMENT.fullmatch(KV_NAME) and not KV_SEGMENT.fullmatch(STORE_NAME)
    assert not STORE_SEGMENT.fullmatch("crescent-store-host1-x")  # no owner pid


def test_segment_never_opens_through_a_symlink(shm_dir: str, store_file: Segment) -> None:
    link = os.path.join(shm_dir, "crescent-store-host1-evil-1")
    os.symlink(store_file.path, link)
    with pytest.raises(OSError):
        Segment(NBYTES, link)


def info(path: str, epoch: int = 1) -> dict:
    return {"shm_path": path, "segment_bytes": NBYTES, "epoch": epoch, "host_id": host_id()}


def test_store_clients_map_only_node_segments(shm_dir: str, store_file: Segment,
                                              caplog: pytest.LogCaptureFixture) -> None:
    link = os.path.join(shm_dir, "crescent-store-host1-evil-1")
    os.symlink(store_file.path, link)
    maps = SegmentMaps(shm_dir)
    try:
        with caplog.at_level(logging.WARNING, logger="common.store.peers"):
            assert maps.get("evil-1", info("/etc/passwd")) is None
            assert maps.get("evil-2", info(link)) is None
            assert maps.get("evil-3", info(store_file.path.replace(shm_dir, "/tmp"))) is None
        assert "node evil-1: not mapping /etc/passwd" in caplog.text
        assert f"node evil-2: not mapping {link}" in caplog.text
        assert maps.mapped() == {}
        seg = maps.get("store_node-0", info(store_file.path))
        assert seg is not None
        ctypes.memmove(store_file.base, b"ours", 4)
        assert ctypes.string_at(seg.base, 4) == b"ours"
        assert SegmentMaps(None).get("n", info(store_file.path)) is None  # no shm_dir: none
    finally:
        maps.close()


def test_workers_map_only_kv_segments(shm_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    dims = dict(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8)
    local = PagedKVMemory(4, **dims)
    peer = PagedKVMemory(4, **dims, shm_path=os.path.join(shm_dir, KV_NAME))
    link = os.path.join(shm_dir, "crescent-kv-host1-decode-9-1")
    os.symlink(peer.shm_path, link)
    maps = PeerKVMaps(local, shm_dir)
    try:
        with caplog.at_level(logging.WARNING, logger="common.kv.shm_kv"):
            assert maps.get("decode-7", "/etc/passwd") is None
            assert maps.get("decode-8", link) is None
            store_like = os.path.join(shm_dir, STORE_NAME)
            Segment(local.nbytes, store_like, create=True).close()
            assert maps.get("decode-6", store_like) is None
        assert "decode-7's KV segment /etc/passwd" in caplog.text
        assert "not a regular file" in caplog.text and "not a Crescent segment" in caplog.text
        mapped = maps.get("decode-0", peer.shm_path)
        assert mapped is not None and mapped.num_blocks == 4
    finally:
        maps.close()
        peer.close()
        local.close()
