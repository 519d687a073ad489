"""KV streaming prefill → decode: the shared-memory path writes exactly the bytes the
transfer engine (real, TCP loopback) writes; path choice and fallback."""
from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.kv.memory import PagedKVMemory
from common.kv.shm_kv import PeerKV
from common.protocol import PrefillTask, StreamTarget
from common.sampling_params import SamplingParams
from common.transfer import TransferAgent, TransferError
from services.prefill.streaming import KVPaths, KVStream, RequestAborted

DIMS = dict(num_layers=4, block_size=16, num_kv_heads=3, head_dim=64)


@pytest.fixture
def shm_dir(tmp_path):
    """Segments in a test-owned directory of the same tmpfs when there is one."""
    d = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    return d


def decode_memory(path: str, num_blocks: int = 12, dtype=torch.float32) -> PagedKVMemory:
    kv = PagedKVMemory(num_blocks, **DIMS, dtype=dtype, shm_path=path)
    assert kv.shm_path == path
    return kv


def prefill_memory(num_blocks: int = 10, dtype=torch.float32) -> PagedKVMemory:
    kv = PagedKVMemory(num_blocks, **DIMS, dtype=dtype)
    kv.data.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(7)))
    return kv


def task(decode_path: str | None, host: str | None, decode_id: str = "decode-0",
         blocks: list[int] | None = None, session: str = "", base: int = 0) -> StreamTarget:
    """Where a PrefillTask with these decode fields sends its KV."""
    return PrefillTask(request_id="r", token_ids=[1], block_keys=[],
                       sampling=SamplingParams(max_tokens=1),
                       decode_id=decode_id, decode_inbox="tcp://127.0.0.1:1",
                       decode_session=session, decode_kv_base=base,
                       decode_block_ids=blocks or [], deadline=0.0,
                       decode_shm_path=decode_path, decode_host_id=host).target


def stream_prompt(stream: KVStream, cached_blocks: int, n_tokens: int, chunk: int) -> int:
    """What a prefill does (layer_io.StepIO): the cached prefix whole, then every layer of
    every chunk, or for a chunked stream (CUDA IPC) each chunk's blocks after it."""
    stream.send_prefix(cached_blocks, cached_blocks)
    start = cached_blocks * DIMS["block_size"]
    for s in range(start, n_tokens, chunk):
        if stream.chunked:
            stream.send_chunk(min(s + chunk, n_tokens))
            continue
        for layer in range(DIMS["num_layers"]):
            stream.on_layer(layer, s, min(s + chunk, n_tokens))
    return asyncio.run(stream.wait(30.0))


def test_shm_path_writes_exactly_the_bytes_the_transfer_engine_writes(agents, shm_dir) -> None:
    a, b = agents
    src = prefill_memory()
    a.register(src.base_address, src.nbytes)
    d_te = decode_memory(f"{shm_dir}/crescent-kv-test-te-{os.getpid()}")
    d_shm = decode_memory(f"{shm_dir}/crescent-kv-test-shm-{os.getpid()}")
    b.register(d_te.base_address, d_te.nbytes)
    local, remote = [9, 2, 5, 0, 7, 3], [11, 4, 0, 6, 1, 8]  # scattered, not sorted
    pool = ThreadPoolExecutor(1)
    try:
        te = KVStream(a, pool, src, local, remote, b.session_id, d_te.base_address)
        peer = PeerKV(d_shm.shm_path, src)
        shm = KVStream(a, pool, src, local, remote, "", 0, peer=peer)
        assert (te.path, shm.path) == ("transfer_engine", "shm")
        # 2 cached blocks, then 90 tokens in chunks of 20 (chunks straddle blocks).
        n_te = stream_prompt(te, 2, 90, 20)
        n_shm = stream_prompt(shm, 2, 90, 20)
        assert n_te == n_shm == te.bytes == shm.bytes
        assert torch.equal(d_te.data, d_shm.data)
        # Exactly the prompt's blocks, every layer; nothing else touched.
        want = torch.zeros_like(d_te.data)
        want[remote] = src.data[local]
        assert torch.equal(d_shm.data, want)
        assert shm.seconds > 0 and te.seconds > 0
        peer.close()
    finally:
        pool.shutdown()
        a.unregister(src.base_address)
        b.unregister(d_te.base_address)
        d_te.close()
        d_shm.close()


def test_bfloat16_kv_streams_half_the_bytes_identically(shm_dir) -> None:
    src = prefill_memory(dtype=torch.bfloat16)
    dst = decode_memory(f"{shm_dir}/crescent-kv-test-bf16-{os.getpid()}", dtype=torch.bfloat16)
    f32 = PagedKVMemory(1, **DIMS)
    assert src.block_nbytes * 2 == f32.block_nbytes
    pool = ThreadPoolExecutor(1)
    try:
        stream = KVStream(None, pool, src, [3, 1], [5, 2], "", 0,  # type: ignore[arg-type]
                          peer=PeerKV(dst.shm_path, src))
        assert stream_prompt(stream, 0, 32, 32) == 2 * src.block_nbytes
        assert torch.equal(dst.data[[5, 2]], src.data[[3, 1]])
    finally:
        pool.shutdown()
        dst.close()


def test_the_launched_path_of_a_gpu_peer_writes_what_shm_writes(shm_dir) -> None:
    """``PeerKVCuda``'s path (block rows once, copies launched from the compute thread, the
    lane only waiting) over host memory, where it runs synchronously: a chunked stream,
    one launch per chunk, writes the same bytes as the shared-memory path's per layer, a
    pipeline stage's window included, and a bad remote block fails the stream as a
    transfer failure."""
    from common.kv.cuda_ipc import PeerKVCuda

    src = prefill_memory()
    d_shm = decode_memory(f"{shm_dir}/crescent-kv-test-ipcref-{os.getpid()}")
    target = PagedKVMemory(12, **DIMS)
    local, remote = [9, 2, 5, 0, 7, 3], [11, 4, 0, 6, 1, 8]
    pool = ThreadPoolExecutor(1)
    try:
        peer = PeerKVCuda(target.data.view(-1).view(torch.uint8), src)
        launched = KVStream(None, pool, src, local, remote, "", 0,  # type: ignore[arg-type]
                            peer=peer)
        shm = KVStream(None, pool, src, local, remote, "", 0,  # type: ignore[arg-type]
                       peer=PeerKV(d_shm.shm_path, src))
        assert launched.path == "cuda_ipc" and launched.chunked and not shm.chunked
        launches = []
        peer.launch = lambda *a, launch=peer.launch: launches.append(a[2]) or launch(*a)
        assert stream_prompt(launched, 2, 90, 20) == stream_prompt(shm, 2, 90, 20)
        assert torch.equal(target.data, d_shm.data)
        assert launches == [range(4)] * 4  # the prefix, then 3 chunks: every layer at once
        # a stage holding layers 1-2 of a 4-layer model: its window of the blocks only
        stage = PagedKVMemory(10, **{**DIMS, "num_layers": 2})
        stage.data.normal_()
        whole = PagedKVMemory(12, **DIMS)
        windowed = PeerKVCuda(whole.data.view(-1).view(torch.uint8), stage, 1, 4)
        windowed.write_blocks([4], [7])
        windowed.write_layer([1], [2], 1)
        assert torch.equal(whole.data[7, 1:3], stage.data[4]) and not whole.data[7, 0].any()
        assert torch.equal(whole.data[2, 2], stage.data[1, 1]) and not whole.data[2, 1].any()
        bad = KVStream(None, pool, src, [0], [12], "", 0, peer=peer)  # type: ignore[arg-type]
        bad.on_layer(0, 0, 16)
        with pytest.raises(TransferError, match=r"remote block 12 outside \[0, 12\)"):
            asyncio.run(bad.wait(5.0))
    finally:
        pool.shutdown()
        d_shm.close()


def test_bad_remote_block_fails_the_stream_like_a_transfer(shm_dir) -> None:
    src = prefill_memory()
    dst = decode_memory(f"{shm_dir}/crescent-kv-test-bad-{os.getpid()}", num_blocks=4)
    pool = ThreadPoolExecutor(1)
    try:
        stream = KVStream(None, pool, src, [0], [4], "", 0,  # type: ignore[arg-type]
                          peer=PeerKV(dst.shm_path, src))
        stream.on_layer(0, 0, 16)
        with pytest.raises(TransferError, match=r"remote block 4 outside \[0, 4\)"):
            asyncio.run(stream.wait(5.0))
        stream.cancel()
        with pytest.raises(RequestAborted):
            stream.on_layer(1, 0, 16)
    finally:
        pool.shutdown()
        dst.close()


def test_layout_mismatch_is_not_mapped(shm_dir) -> None:
    src = prefill_memory()
    other = PagedKVMemory(5, num_layers=3, block_size=16, num_kv_heads=3, head_dim=64,
                          shm_path=f"{shm_dir}/crescent-kv-test-layout-{os.getpid()}")
    try:
        with pytest.raises(OSError, match="KV layouts differ"):
            PeerKV(other.shm_path, src)
    finally:
        other.close()


def test_path_choice_and_fallback(shm_dir, caplog) -> None:
    src = prefill_memory()
    path = f"{shm_dir}/crescent-kv-test-choice-{os.getpid()}"
    dst = decode_memory(path)
    try:
        auto = KVPaths("auto", src, host_id="h1", shm_dir=shm_dir)
        assert auto.peer(task(path, "h1")) is not None  # same host: mapped
        assert auto.peer(task(path, "h1")) is auto.peer(task(path, "h1"))  # mapped once
        assert auto.peer(task(path, "h2", decode_id="decode-1")) is None  # other host
        assert auto.peer(task(None, "h1")) is None  # nothing advertised
        assert KVPaths("transfer_engine", src, "h1").peer(task(path, "h1")) is None
        shm = KVPaths("shm", src, "h1", shm_dir)
        assert shm.peer(task(path, "h2")) is not None  # host check off
        with caplog.at_level(logging.WARNING):
            missing = task(path + "-gone", "h1", decode_id="decode-2", blocks=[3])
            assert auto.peer(missing) is None  # cannot be opened: transfer engine
        assert "using the transfer engine" in caplog.text
        stream = auto.open(None, None, src, [0], missing)  # type: ignore[arg-type]
        assert stream.path == "transfer_engine"
        # The decode worker restarted with a new file: the new one is mapped.
        dst2 = decode_memory(path + "-2")
        assert auto.peer(task(path + "-2", "h1")).path == path + "-2"
        dst2.close()
        auto.close()
        with pytest.raises(ValueError, match="kv_path must be one of"):
            KVPaths("tcp", src, "h1")
    finally:
        dst.close()


class SlowPeer:
    """A peer whose writes take longer than the stream's deadline."""

    via = "shm"

    def write_layer(self, local: list[int], remote: list[int], layer: int) -> int:
        import time
        time.sleep(0.5)
        return 1

    def write_blocks(self, local: list[int], remote: list[int]) -> int:
        return 1


def test_wait_has_a_deadline_on_the_shm_path_too() -> None:
    src = prefill_memory()
    pool = ThreadPoolExecutor(1)
    try:
        stream = KVStream(None, pool, src, [0], [0], "", 0,  # type: ignore[arg-type]
                          peer=SlowPeer())  # type: ignore[arg-type]
        stream.on_layer(0, 0, 16)
        stream.on_layer(1, 0, 16)
        with pytest.raises(TransferError, match=r"KV stream \(shm\) missed its 0.3s deadline"):
            asyncio.run(stream.wait(0.3))
        stream.cancel()
    finally:
        pool.shutdown()


def test_a_closed_mapping_refuses_writes(shm_dir) -> None:
    src = prefill_memory()
    dst = decode_memory(f"{shm_dir}/crescent-kv-test-closed-{os.getpid()}")
    try:
        peer = PeerKV(dst.shm_path, src)
        assert peer.write_layer([1], [2], 0) == src.layer_nbytes
        assert torch.equal(dst.data[2, 0], src.data[1, 0])
        with pytest.raises(IndexError, match=r"local blocks \[10\] outside \[0, 10\)"):
            peer.write_blocks([10], [0])
        with pytest.raises(IndexError, match=r"layer 4 outside \[0, 4\)"):
            peer.write_layer([0], [0], 4)
        peer.close()
        with pytest.raises(OSError, match="no longer mapped"):
            peer.write_layer([1], [2], 0)
    finally:
        dst.close()
