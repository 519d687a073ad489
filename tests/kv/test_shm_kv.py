"""KV memory in /dev/shm: created exclusively, the same layout and addresses, unlinked on
close, at exit, and by the next worker when its process was killed."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from common.host import host_id
from common.kv.memory import PagedKVMemory
from common.kv.shm_kv import segment_path, sweep_stale, worker_segment

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dims() -> dict:
    return dict(num_blocks=5, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)


def test_shared_memory_has_the_private_layout_and_is_unlinked_on_close() -> None:
    path = f"/dev/shm/crescent-kv-test-layout-{os.getpid()}"
    m = PagedKVMemory(**dims(), shm_path=path)
    ref = PagedKVMemory(**dims())
    try:
        assert m.shm_path == path and os.path.getsize(path) == m.nbytes == ref.nbytes
        assert m.shape == ref.shape and m.data.is_contiguous()
        assert (m.block_nbytes, m.layer_nbytes) == (ref.block_nbytes, ref.layer_nbytes)
        assert m.layer_address(2, 1) == m.base_address + 2 * m.block_nbytes + m.layer_nbytes
        assert m.data.abs().sum() == 0
        m.data[2, 1] = 7.0
        with open(path, "rb") as fh:  # what another process sees through the file
            raw = fh.read()
        got = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(m.shape)
        assert torch.equal(got, m.data)
    finally:
        m.close()
    assert not os.path.exists(path) and m.shm_path is None
    assert m.data[2, 1].sum() == 7.0 * m.data[2, 1].numel()  # mapping lives on
    m.close()  # idempotent


def test_an_existing_file_is_never_reused(caplog) -> None:
    path = f"/dev/shm/crescent-kv-test-exists-{os.getpid()}"
    with open(path, "wb") as fh:
        fh.write(b"someone else's")
    try:
        m = PagedKVMemory(**dims(), shm_path=path)
        assert m.shm_path is None and m.segment is None  # private memory instead
        assert "KV memory not shared" in caplog.text
        with open(path, "rb") as fh:
            assert fh.read() == b"someone else's"
    finally:
        os.unlink(path)


def test_worker_segment_follows_kv_path_and_device() -> None:
    assert worker_segment("decode-0", "transfer_engine", "cpu") is None
    assert worker_segment("decode-0", "auto", "cuda") is None
    assert worker_segment("decode-0", "shm", "cpu") == segment_path("decode-0")
    host = socket.gethostname()
    assert segment_path("decode-0") == f"/dev/shm/crescent-kv-{host}-decode-0-{os.getpid()}"
    with pytest.raises(ValueError, match="kv_path must be one of"):
        worker_segment("decode-0", "rdma", "cpu")
    assert host_id() == host_id() and "/" in host_id()


CHILD = """
import os, sys, time
sys.path.insert(0, {root!r})
from common.kv.memory import PagedKVMemory
from common.kv.shm_kv import close_at_exit, segment_path
kv = PagedKVMemory(4, 2, 4, 2, 8, shm_path=segment_path("test-{tag}"))
close_at_exit(kv)
print(kv.shm_path, flush=True)
if {hang}:
    time.sleep(60)
"""


def _child(tag: str, hang: bool) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(root=ROOT, tag=tag, hang=hang)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_cleaned_at_exit_and_after_a_kill() -> None:
    proc, path = _child("exit", hang=False)
    assert proc.wait(30) == 0
    assert path.startswith(f"/dev/shm/crescent-kv-{socket.gethostname()}-test-exit-")
    assert not os.path.exists(path)

    proc, path = _child("kill", hang=True)
    try:
        assert os.path.exists(path)
        assert path.rsplit("/", 1)[1] not in sweep_stale()  # its process is alive
        assert os.path.exists(path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert os.path.exists(path)  # SIGKILL: no chance to clean up
    other = f"/dev/shm/crescent-kv-not-{socket.gethostname()}-decode-0-{proc.pid}"
    open(other, "wb").close()  # another container's, same dead pid: not ours to remove
    try:
        assert path.rsplit("/", 1)[1] in sweep_stale()  # the next worker's sweep
        assert not os.path.exists(path) and os.path.exists(other)
    finally:
        os.unlink(other)
