"""Store master round trips while it holds many objects.

``python benchmarks/store_master.py [--objects 1000,10000,50000]`` (~1 minute). For each
count: a fresh store master and node (real processes, as in a cluster), filled with that
many committed 4 KiB objects through a ``StoreClient`` over shared memory; then, for
5 seconds, one-key ``batch_exists`` round trips every 2 ms, their latency and the
master's CPU (share of one core). Every
prefill step that writes KV layer by layer asks the master for grants, and every prefix
lookup asks it what it holds, so this latency is on the prefill's path. A master whose
periodic work grows with the objects it holds shows it here as a tail. Prints a table,
then one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.store import free_port, stop, wait_ready  # noqa: E402

SIZE = 4 << 10  # bytes per object
BATCH = 1000  # objects per put
PROBE_S = 5.0


def start(objects: int, shm_dir: str) -> tuple[str, list[subprocess.Popen]]:
    """A master and one node with room for ``objects``; returns the master's address."""
    base = free_port()
    settings = ["--set", f"base_port={base}", "--set", f"store.shm_dir={shm_dir!r}",
                "--set", f"store.segment_bytes={objects * SIZE * 2 + (64 << 20)}"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen([sys.executable, "-m", "services.store_master", *settings],
                              cwd=ROOT, **quiet)]
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "services.store_node", *settings],
                                      cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True))
        wait_ready(procs[-1])
    except BaseException:
        stop(procs)
        raise
    return f"tcp://127.0.0.1:{base + 2}", procs


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(address: str, master_pid: int, objects: int,
                  shm_dir: str) -> dict[str, float]:
    from common.store.client import StoreClient
    from common.transfer import TransferAgent, TransferConfig

    agent = TransferAgent(TransferConfig())
    client = StoreClient(address, agent, timeout_s=30.0, shm_dir=shm_dir)
    await client.start()
    src = np.ones(BATCH * SIZE, dtype=np.uint8)
    client.register_local(src.ctypes.data, src.nbytes)
    addresses = [src.ctypes.data + i * SIZE for i in range(BATCH)]
    try:
        for start_at in range(0, objects, BATCH):
            n = min(BATCH, objects - start_at)
            keys = [f"obj-{i}".encode().ljust(16, b".") for i in range(start_at, start_at + n)]
            stored = await client.batch_put_from(keys, addresses[:n], SIZE)
            if stored != n:
                raise RuntimeError(f"the store took {stored} of {n} objects")
        await asyncio.sleep(1.0)
        probe = [b"obj-0".ljust(16, b".")]
        ms: list[float] = []
        cpu0, end = cpu_seconds(master_pid), time.monotonic() + PROBE_S
        while time.monotonic() < end:
            t = time.perf_counter()
            if await client.batch_exists(probe) != [True]:
                raise RuntimeError("a stored object went missing")
            ms.append((time.perf_counter() - t) * 1000)
            await asyncio.sleep(0.002)
        cpu = (cpu_seconds(master_pid) - cpu0) / PROBE_S
    finally:
        await client.close()
        agent.close()
    ms.sort()
    return {"objects": objects, "calls": len(ms), "p50_ms": ms[len(ms) // 2],
            "p99_ms": ms[int(len(ms) * 0.99)], "max_ms": ms[-1], "master_cpu": cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", default="1000,10000,50000",
                    help="comma-separated object counts, one fresh store each")
    counts = [int(x) for x in ap.parse_args().objects.split(",")]
    rows = []
    for objects in counts:
        shm_dir = tempfile.mkdtemp(prefix="crescent-bench-", dir="/dev/shm")
        address, procs = start(objects, shm_dir)
        try:
            rows.append(asyncio.run(measure(address, procs[0].pid, objects, shm_dir)))
        finally:
            stop(procs)
            shutil.rmtree(shm_dir, ignore_errors=True)
    print(f"{'objects':>8}  {'calls':>6}  {'p50 ms':>7}  {'p99 ms':>7}  {'max ms':>7}  "
          f"{'master CPU':>10}")
    for r in rows:
        print(f"{r['objects']:>8}  {r['calls']:>6}  {r['p50_ms']:>7.2f}  {r['p99_ms']:>7.2f}  "
              f"{r['max_ms']:>7.2f}  {r['master_cpu']:>10.0%}")
    print(json.dumps({"bench": "store_master", "object_bytes": SIZE, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
