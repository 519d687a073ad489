"""Store master round trips while it holds many objects.

``python benchmarks/store_master.py [--objects 1000,10000,50000] [--churn]`` (~1 minute;
``--churn`` ~2). For each count: a fresh store master and node (real processes, as in a
cluster), filled with that many committed 4 KiB objects through a ``StoreClient`` over
shared memory; then, for 5 seconds (``--churn``: 20), one-key ``batch_exists`` round trips
every 2 ms, their latency and the master's CPU (share of one core). Every prefill step that
writes KV layer by layer asks the master for grants, and every prefix lookup asks it what
it holds, so this latency is on the prefill's path. A master whose periodic work grows with
the objects it holds shows it here as a tail. ``--churn``: meanwhile a second client keeps
putting batches of 1,000 new objects into a store sized for ``objects`` (so it evicts at
its watermark, as a full store in service does): the tail then also shows what creating
and dropping objects costs the master (eviction, the interpreter's garbage collector).
Prints a table, then one JSON line.
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


def start(objects: int, shm_dir: str, churn: bool) -> tuple[str, list[subprocess.Popen]]:
    """A master and one node with room for ``objects`` (twice that without ``churn``);
    returns the master's address."""
    base = free_port()
    room = objects * SIZE + (4 << 20) if churn else objects * SIZE * 2 + (64 << 20)
    settings = ["--set", f"base_port={base}", "--set", f"store.shm_dir={shm_dir!r}",
                "--set", f"store.segment_bytes={room}"]
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


async def measure(address: str, master_pid: int, objects: int, shm_dir: str,
                  churn: bool) -> dict[str, float]:
    from common.store.client import StoreClient
    from common.transfer import TransferAgent, TransferConfig

    agent = TransferAgent(TransferConfig())
    clients = [StoreClient(address, agent, timeout_s=30.0, shm_dir=shm_dir)
               for _ in range(2 if churn else 1)]
    src = np.ones(BATCH * SIZE, dtype=np.uint8)
    for client in clients:
        await client.start()
        client.register_local(src.ctypes.data, src.nbytes)
    addresses = [src.ctypes.data + i * SIZE for i in range(BATCH)]
    client = clients[0]

    async def put(first: int, n: int) -> int:
        keys = [f"obj-{i}".encode().ljust(16, b".") for i in range(first, first + n)]
        return await clients[-1].batch_put_from(keys, addresses[:n], SIZE)

    async def churning() -> int:  # new objects as fast as the master takes them
        first = objects
        while True:
            await put(first, BATCH)
            first += BATCH

    writer = None
    try:
        for start_at in range(0, objects, BATCH):
            n = min(BATCH, objects - start_at)
            if await put(start_at, n) != n:
                raise RuntimeError(f"the store took fewer than {n} objects")
        await asyncio.sleep(1.0)
        probe = [b"obj-0".ljust(16, b".")]
        await client.batch_exists(probe)  # churn evicts obj-0: only the latency counts
        writer = asyncio.ensure_future(churning()) if churn else None
        ms: list[float] = []
        seconds = PROBE_S * (4 if churn else 1)
        cpu0, end = cpu_seconds(master_pid), time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            if await client.batch_exists(probe) != [True] and not churn:
                raise RuntimeError("a stored object went missing")
            ms.append((time.perf_counter() - t) * 1000)
            await asyncio.sleep(0.002)
        cpu = (cpu_seconds(master_pid) - cpu0) / seconds
    finally:
        if writer is not None:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
        for c in clients:
            await c.close()
        agent.close()
    ms.sort()
    return {"objects": objects, "calls": len(ms), "p50_ms": ms[len(ms) // 2],
            "p99_ms": ms[int(len(ms) * 0.99)], "max_ms": ms[-1], "master_cpu": cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", default="1000,10000,50000",
                    help="comma-separated object counts, one fresh store each")
    ap.add_argument("--churn", action="store_true",
                    help="meanwhile put new objects into a full store (it evicts)")
    args = ap.parse_args()
    counts = [int(x) for x in args.objects.split(",")]
    rows = []
    for objects in counts:
        shm_dir = tempfile.mkdtemp(prefix="crescent-bench-", dir="/dev/shm")
        address, procs = start(objects, shm_dir, args.churn)
        try:
            rows.append(asyncio.run(measure(address, procs[0].pid, objects, shm_dir,
                                            args.churn)))
        finally:
            stop(procs)
            shutil.rmtree(shm_dir, ignore_errors=True)
    print(f"{'objects':>8}  {'calls':>6}  {'p50 ms':>7}  {'p99 ms':>7}  {'max ms':>7}  "
          f"{'master CPU':>10}")
    for r in rows:
        print(f"{r['objects']:>8}  {r['calls']:>6}  {r['p50_ms']:>7.2f}  {r['p99_ms']:>7.2f}  "
              f"{r['max_ms']:>7.2f}  {r['master_cpu']:>10.0%}")
    print(json.dumps({"bench": "store_master", "object_bytes": SIZE, "churn": args.churn,
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
