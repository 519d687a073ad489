"""Store data-path benchmark: our pool vs Mooncake's own store vs memcpy.

``python benchmarks/store.py`` (one invocation, ~40 s). For 64 KiB, 1 MiB and 4 MiB values,
batches totalling 64 MiB: batch put and batch get GB/s of our pool (same-host shm path and
transfer-engine TCP path), of Mooncake Store (mooncake_master + a storage process + a pure
client, TCP), the three clients' rounds interleaved (benchmarks/store_clients.py), and
single-thread memcpy; then master metadata ops/s for batch exists of 1,000 keys. Then, where network namespaces can be made (root, ``ip``), the same batch put and get of
1 MiB values across two hosts (benchmarks/store_hosts.py): our master and node, and Mooncake's
master and storage process, in one namespace, each benchmark client in another, interleaved.
Prints a table and, last, one JSON line for 1 MiB values.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.store_clients import (  # noqa: E402
    LEASE_S, TOTAL, ClientProc, MooncakeClient, OursClient, buffers, gbps, interleave,
    mooncake_store, rates, serve,
)

SIZES = [64 << 10, 1 << 20, 4 << 20]
ROUNDS = 5
BIN = os.path.dirname(sys.executable)
LOCAL = "127.0.0.1"
Rates = dict[int, tuple[float, float]]  # value size → (put GB/s, get GB/s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


# ------------------------------------------------------------------- one host
def bench_one_host(ours: str, mooncake: str, shm_dir: str) -> dict[str, Rates]:
    """Per client, per value size, (put GB/s, get GB/s), the three clients' rounds
    interleaved: ours on its same-host path, ours forced onto the transfer engine (TCP
    loopback), and Mooncake Store's. Fails unless each of ours took the path it names."""
    argv = {"shm": phase_argv("ours-client", ours, shm_dir=shm_dir),
            "tcp": phase_argv("ours-tcp-client", ours, shm_dir=shm_dir),
            "mooncake": phase_argv("mooncake-client", mooncake)}
    clients: dict[str, ClientProc] = {}
    try:
        for name, command in argv.items():
            clients[name] = ClientProc(command)
        out: dict[str, Rates] = {name: {} for name in clients}
        for size in SIZES:
            for name, times in interleave(clients, size, ROUNDS).items():
                out[name][size] = rates(times)
        shm, tcp = clients["shm"].finish(), clients["tcp"].finish()
        moved = 2 * TOTAL * (ROUNDS + 1) * len(SIZES)
        if not shm["mapped"] or shm["engine_bytes"] or tcp["mapped"] or \
                tcp["engine_bytes"] != moved:
            raise RuntimeError(f"a client took the wrong path: shm {shm}, tcp {tcp} "
                               f"(the transfer engine should have moved {moved} bytes)")
        return out
    finally:
        for client in clients.values():
            client.kill()


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


# ------------------------------------------------------------------- mooncake
def mooncake_storage(master: str, hostname: str) -> None:
    """The storage process: contributes a 1 GiB segment and serves until killed."""
    store = mooncake_store(1 << 30, master, hostname)
    print("ready", flush=True)
    while True:
        time.sleep(3600)
    del store


def phase_argv(phase: str, master: str, hostname: str = LOCAL, shm_dir: str = "") -> list[str]:
    """The command of one process of a run (``--phase``)."""
    return [sys.executable, os.path.abspath(__file__), "--phase", phase, "--master", master,
            "--hostname", hostname, "--shm-dir", shm_dir]


# ------------------------------------------------------------------- servers
Popen = Callable[..., subprocess.Popen]  # subprocess.Popen, or one that starts on another host


def start_servers(popen: Popen, ours_base: int, mooncake_port: int, shm_dir: str,
                  host: str = LOCAL) -> list[subprocess.Popen]:
    """Our store master and node (inbox ``ours_base`` + 2, segment file in ``shm_dir``) and
    Mooncake's master (RPC ``mooncake_port``, metrics the next port) and storage process,
    all at ``host``; returns once both nodes serve."""
    settings = ["--set", f"base_port={ours_base}", "--set", f"host={host!r}",
                "--set", f"store.policy.lease_s={LEASE_S}", "--set",
                f"store.segment_bytes={1 << 30}", "--set", f"store.shm_dir={shm_dir!r}"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    ready = {"stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL, "text": True}
    procs = [popen([sys.executable, "-m", "services.store_master", *settings], cwd=ROOT,
                   **quiet),
             popen([os.path.join(BIN, "mooncake_master"), f"--rpc_port={mooncake_port}",
                    f"--metrics_port={mooncake_port + 1}"], **quiet)]
    try:
        procs.append(popen([sys.executable, "-m", "services.store_node", *settings], cwd=ROOT,
                           **ready))
        wait_ready(procs[-1])
        procs.append(popen(phase_argv("mooncake-storage", f"{host}:{mooncake_port}", host),
                           **ready))
        wait_ready(procs[-1])
    except BaseException:
        stop(procs)
        raise
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait(10)


# ------------------------------------------------------------------- report
def run_phase(a: argparse.Namespace) -> None:
    """One process of a run: Mooncake's storage process, or a benchmark client driven
    over stdin/stdout (benchmarks/store_clients.py: ``serve``)."""
    if a.phase == "mooncake-storage":
        mooncake_storage(a.master, a.hostname)
    elif a.phase == "mooncake-client":
        serve(MooncakeClient(a.master, a.hostname))
    elif a.phase in ("ours-client", "ours-tcp-client"):
        serve(OursClient(a.master, a.hostname, a.phase == "ours-client", a.shm_dir))
    else:
        raise SystemExit(f"unknown phase {a.phase!r}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", default="all")
    ap.add_argument("--master", default="")
    ap.add_argument("--hostname", default=LOCAL, help="this process's own address")
    ap.add_argument("--shm-dir", default="")
    ap.add_argument("--cross-host", choices=["on", "off", "only"], default="on",
                    help="also measure across two network namespaces (needs root)")
    a = ap.parse_args()
    if a.phase != "all":
        run_phase(a)
        return 0
    from benchmarks.store_hosts import cross_host_or_reason

    if a.cross_host == "only":
        cross, why = cross_host_or_reason()
        print(json.dumps(cross_summary(cross, why)))
        return 0 if cross is not None else 1
    shm_dir = tempfile.mkdtemp(prefix="crescent-bench-", dir="/dev/shm")
    ours_base, mooncake_port = free_port(), free_port()
    procs = start_servers(subprocess.Popen, ours_base, mooncake_port, shm_dir)
    ours_address = f"tcp://{LOCAL}:{ours_base + 2}"
    try:
        one = bench_one_host(ours_address, f"{LOCAL}:{mooncake_port}", shm_dir)
        rate = asyncio.run(_exists_rate(ours_address))
    finally:
        stop(procs)
        shutil.rmtree(shm_dir, ignore_errors=True)
    mem = {size: bench_memcpy(size) for size in SIZES}
    cross, why = cross_host_or_reason() if a.cross_host == "on" else (None, "--cross-host off")
    print(f"{'value':>7} | {'ours put':>9} {'ours get':>9} | {'tcp put':>8} {'tcp get':>8} | "
          f"{'mc put':>7} {'mc get':>7} | {'memcpy':>7}   (GB/s, batches of 64 MiB, one host)")
    for size in SIZES:
        (sp, sg), (tp, tg), (mp, mg) = (one[name][size] for name in ("shm", "tcp", "mooncake"))
        label = f"{size >> 10}K" if size < (1 << 20) else f"{size >> 20}M"
        print(f"{label:>7} | {sp:9.2f} {sg:9.2f} | {tp:8.2f} {tg:8.2f} | {mp:7.2f} {mg:7.2f} |"
              f" {mem[size]:7.2f}")
    print(f"master batch_exists(1,000 keys): {rate:,.0f} calls/s = {rate * 1000:,.0f} keys/s")
    mib = 1 << 20
    print(json.dumps({
        "value_bytes": mib,
        "put_gbps": round(one["shm"][mib][0], 3), "get_gbps": round(one["shm"][mib][1], 3),
        "tcp_put_gbps": round(one["tcp"][mib][0], 3),
        "tcp_get_gbps": round(one["tcp"][mib][1], 3),
        "mooncake_put_gbps": round(one["mooncake"][mib][0], 3),
        "mooncake_get_gbps": round(one["mooncake"][mib][1], 3),
        "memcpy_gbps": round(mem[mib], 3),
        "exists_1000_calls_per_s": round(rate, 1), "exists_keys_per_s": round(rate * 1000),
        **cross_summary(cross, why),
    }))
    return 0


def cross_summary(cross: Optional[dict[str, Any]], why: str) -> dict[str, Any]:
    """The cross-host figures for the last JSON line (printed as a table on the way), or
    why there are none."""
    if cross is None:
        print(f"cross-host: not measured ({why})")
        return {"cross_host": None, "cross_host_skipped": why}
    print("cross-host, 1M values, 2 network namespaces, TCP (GB/s; ours/mc per round pair: "
          "quartiles)")
    out: dict[str, Any] = {"cross_host": "netns"}
    for op in ("put", "get"):
        ours, theirs = cross[op]
        q1, q2, q3 = cross[f"{op}_pair_ratios"]
        print(f"  {op}: ours {ours:.2f}  mc {theirs:.2f}  ours/mc {ours / theirs:.2f}x "
              f"(pairs {q1:.2f} / {q2:.2f} / {q3:.2f})")
        out.update({f"cross_{op}_gbps": round(ours, 3),
                    f"mooncake_cross_{op}_gbps": round(theirs, 3),
                    f"cross_{op}_ratio": round(ours / theirs, 3)})
    return out


if __name__ == "__main__":
    sys.exit(main())
