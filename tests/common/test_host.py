"""Host identity (common/host.py): boot id + network namespace decide "same host"."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.host import host_id, read_host_id, same_host
from common.store.peers import SegmentMaps
from common.store.shm import Segment, owned_path
from launch.netns import TestBed, available

OK, WHY = available()


def test_identity_is_boot_id_and_netns_inode(tmp_path: Path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("b0b\n")
    net = tmp_path / "net"
    net.write_text("")
    assert read_host_id(str(boot), str(net)) == f"b0b/net:{os.stat(net).st_ino}"
    assert read_host_id(str(tmp_path / "none"), str(tmp_path / "none")) == \
        "unknown/net:unknown"
    assert host_id() == read_host_id() and host_id().count("/net:") == 1


def test_same_host_needs_our_exact_identity() -> None:
    assert same_host(host_id())
    assert not same_host(None) and not same_host("") and not same_host(42)
    assert not same_host(host_id().split("/net:")[0] + "/net:1")  # another namespace
    assert not same_host("unknown/net:unknown")


@pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}")
def test_another_network_namespace_is_another_host() -> None:
    code = "from common.host import host_id; print(host_id())"
    with TestBed(1, "cmhid", "10.79.1") as bed:
        there = bed.run("h1", [sys.executable, "-c", code], check=True).stdout.strip()
    here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert here == host_id()  # another process in this namespace: the same host
    assert there != here and there.split("/net:")[0] == here.split("/net:")[0]


def test_store_segments_are_mapped_only_from_the_same_host() -> None:
    seg = Segment(1 << 16, owned_path("/dev/shm", "store", "hosttest"), create=True)
    try:
        info = {"shm_path": seg.path, "segment_bytes": seg.nbytes, "epoch": 1}
        elsewhere = SegmentMaps("/dev/shm")  # the file is visible, the node is not ours
        assert elsewhere.get("n", dict(info, host_id="other/net:1")) is None
        assert elsewhere.get("m", info) is None  # no identity published: never mapped
        here = SegmentMaps("/dev/shm").get("n", dict(info, host_id=host_id()))
        assert here is not None and here.nbytes == seg.nbytes
        here.close()
    finally:
        seg.close(unlink=True)
