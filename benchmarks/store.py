"""Store data-path benchmark: our pool vs Mooncake's own store vs memcpy.

``python benchmarks/store.py`` (one invocation, ~1 minute). For 64 KiB, 1 MiB and 4 MiB values,
batches totalling 64 MiB: batch put and batch get GB/s of our pool (same-host shm path and
transfer-engine TCP path), of Mooncake Store (mooncake_master + a storage process + a pure
client, TCP), and single-thread memcpy; then master metadata ops/s for batch exists of 1,000
keys. Prints a table and, last, one JSON line for 1 MiB values.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TOTAL = 64 << 20
SIZES = [64 << 10, 1 << 20, 4 << 20]
ROUNDS = 5
LEASE_S = 0.4  # the benchmark master's read lease (default 5 s)
BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def buffers() -> tuple[np.ndarray, np.ndarray]:
    src = np.random.default_rng(1).integers(0, 256, TOTAL, dtype=np.uint8)
    dst = np.ones(TOTAL, dtype=np.uint8)  # touched: no page faults inside timings
    return src, dst


def slots(src: np.ndarray, dst: np.ndarray, size: int) -> tuple[int, list[int], list[int]]:
    """How many objects of ``size`` fill the buffers, and their source/destination addresses."""
    n = TOTAL // size
    return (n, [src.ctypes.data + i * size for i in range(n)],
            [dst.ctypes.data + i * size for i in range(n)])


def gbps(seconds: list[float]) -> float:
    return TOTAL / statistics.median(seconds) / 1e9


def wait_ready(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline() if proc.stdout else ""
        if "ready" in line:
            return
        if not line and proc.poll() is not None:
            break
    raise RuntimeError("store process did not become ready")


# ------------------------------------------------------------------- memcpy
def bench_memcpy(size: int) -> float:
    src, dst = buffers()
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for off in range(0, TOTAL, size):
            ctypes.memmove(dst.ctypes.data + off, src.ctypes.data + off, size)
        times.append(time.perf_counter() - t0)
    return gbps(times)


# ------------------------------------------------------------------- ours
async def _ours_sizes(address: str, use_shm: bool,
                      shm_dir: str) -> dict[int, tuple[float, float]]:
    from common.store.client import StoreClient
    from common.transfer import TransferAgent, TransferConfig

    transfer = TransferAgent(TransferConfig())
    client = StoreClient(address, transfer, timeout_s=30.0, use_shm=use_shm, shm_dir=shm_dir)
    await client.start()
    src, dst = buffers()
    client.register_local(src.ctypes.data, TOTAL)
    client.register_local(dst.ctypes.data, TOTAL)
    out = {}
    for size in SIZES:
        n, addr_s, addr_d = slots(src, dst, size)
        puts, gets = [], []
        for r in range(ROUNDS + 1):  # round 0 warms up (maps, first touch)
            keys = [os.urandom(16) for _ in range(n)]
            t0 = time.perf_counter()
            assert await client.batch_put_from(keys, addr_s, size) == n
            t1 = time.perf_counter()
            assert all(await client.batch_get_into(keys, addr_d, size))
            t2 = time.perf_counter()
            if r == 0:
                assert (src == dst).all(), "bytes differ"
                dst[:] = 1
            else:
                puts.append(t1 - t0)
                gets.append(t2 - t1)
            await asyncio.sleep(LEASE_S)  # removal waits for the get's lease to lapse
            assert await client.remove(keys) == n
        out[size] = (gbps(puts), gbps(gets))
    await client.close()
    transfer.close()
    return out


async def _exists_rate(address: str) -> float:
    from common.store.client import StoreClient

    client = StoreClient(address, None, timeout_s=10.0)
    await client.start()
    keys = [os.urandom(16) for _ in range(1000)]
    await client.batch_exists(keys)
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        await client.batch_exists(keys)
        calls += 1
    rate = calls / (time.perf_counter() - t0)
    await client.close()
    return rate


def bench_ours() -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="crescent-bench-", dir="/dev/shm")
    base = free_port()  # the master's inbox is base + 2 (common/config.py)
    address = f"tcp://127.0.0.1:{base + 2}"
    settings = ["--set", f"base_port={base}", "--set", f"store.policy.lease_s={LEASE_S}",
                "--set", f"store.segment_bytes={512 << 20}", "--set", f"store.shm_dir={tmp!r}"]
    procs = [subprocess.Popen([sys.executable, "-m", "services.store_master", *settings],
                              cwd=ROOT, stderr=subprocess.DEVNULL)]
    try:
        node = subprocess.Popen([sys.executable, "-m", "services.store_node", *settings],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        procs.append(node)
        wait_ready(node)
        shm = asyncio.run(_ours_sizes(address, use_shm=True, shm_dir=tmp))
        tcp = asyncio.run(_ours_sizes(address, use_shm=False, shm_dir=tmp))
        exists = asyncio.run(_exists_rate(address))
        return {"shm": shm, "tcp": tcp, "exists_calls_per_s": exists}
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------- mooncake
def _mooncake_store(segment: int, master: str) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"mooncake setup failed rc={rc}")
    return store


def mooncake_storage(master: str) -> None:
    """The storage process: contributes a 1 GiB segment and serves until killed."""
    store = _mooncake_store(1 << 30, master)
    print("ready", flush=True)
    while True:
        time.sleep(3600)
    del store


def mooncake_client(master: str) -> None:
    store = _mooncake_store(0, master)
    src, dst = buffers()
    assert store.register_buffer(src.ctypes.data, TOTAL) == 0
    assert store.register_buffer(dst.ctypes.data, TOTAL) == 0
    out = {}
    for size in SIZES:
        n, addr_s, addr_d = slots(src, dst, size)
        puts, gets = [], []
        for r in range(ROUNDS + 1):
            keys = [os.urandom(16).hex() for _ in range(n)]
            t0 = time.perf_counter()
            rcs = store.batch_put_from(keys, addr_s, [size] * n)
            t1 = time.perf_counter()
            got = store.batch_get_into(keys, addr_d, [size] * n)
            t2 = time.perf_counter()
            assert all(x == 0 for x in rcs), rcs[:4]
            assert all(x == size for x in got), got[:4]
            if r == 0:
                assert (src == dst).all(), "mooncake bytes differ"
            else:
                puts.append(t1 - t0)
                gets.append(t2 - t1)
            store.remove_all(True)
        out[size] = (gbps(puts), gbps(gets))
    print(json.dumps({str(k): v for k, v in out.items()}), flush=True)


def bench_mooncake() -> dict[int, tuple[float, float]]:
    port = free_port()
    master = f"127.0.0.1:{port}"
    procs = [subprocess.Popen([os.path.join(BIN, "mooncake_master"), f"--rpc_port={port}",
                               ],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    me = [sys.executable, os.path.abspath(__file__)]
    try:
        time.sleep(1.0)
        storage = subprocess.Popen(me + ["--phase", "mooncake-storage", "--master", master],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(storage)
        wait_ready(storage)
        client = subprocess.run(me + ["--phase", "mooncake-client", "--master", master],
                                capture_output=True, text=True, timeout=300)
        line = [x for x in client.stdout.splitlines() if x.startswith("{")]
        if client.returncode != 0 or not line:
            raise RuntimeError(f"mooncake client failed: {client.stderr[-2000:]}")
        return {int(k): tuple(v) for k, v in json.loads(line[-1]).items()}
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


# ------------------------------------------------------------------- report
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", default="all")
    ap.add_argument("--master", default="")
    a = ap.parse_args()
    phases: dict[str, Callable[[], Any]] = {
        "mooncake-storage": lambda: mooncake_storage(a.master),
        "mooncake-client": lambda: mooncake_client(a.master),
    }
    if a.phase in phases:
        phases[a.phase]()
        return 0
    ours = bench_ours()
    moon = bench_mooncake()
    mem = {size: bench_memcpy(size) for size in SIZES}
    print(f"{'value':>7} | {'ours put':>9} {'ours get':>9} | {'tcp put':>8} {'tcp get':>8} | "
          f"{'mc put':>7} {'mc get':>7} | {'memcpy':>7}   (GB/s, batches of 64 MiB)")
    for size in SIZES:
        (sp, sg), (tp, tg), (mp, mg) = ours["shm"][size], ours["tcp"][size], moon[size]
        label = f"{size >> 10}K" if size < (1 << 20) else f"{size >> 20}M"
        print(f"{label:>7} | {sp:9.2f} {sg:9.2f} | {tp:8.2f} {tg:8.2f} | {mp:7.2f} {mg:7.2f} |"
              f" {mem[size]:7.2f}")
    rate = ours["exists_calls_per_s"]
    print(f"master batch_exists(1,000 keys): {rate:,.0f} calls/s = {rate * 1000:,.0f} keys/s")
    mib = 1 << 20
    print(json.dumps({
        "value_bytes": mib,
        "put_gbps": round(ours["shm"][mib][0], 3), "get_gbps": round(ours["shm"][mib][1], 3),
        "tcp_put_gbps": round(ours["tcp"][mib][0], 3),
        "tcp_get_gbps": round(ours["tcp"][mib][1], 3),
        "mooncake_put_gbps": round(moon[mib][0], 3), "mooncake_get_gbps": round(moon[mib][1], 3),
        "memcpy_gbps": round(mem[mib], 3),
        "exists_1000_calls_per_s": round(rate, 1), "exists_keys_per_s": round(rate * 1000),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
