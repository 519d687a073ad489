"""The store benchmark across two hosts: network namespaces joined by veth and a bridge.

Host ``h1`` runs the servers: our store master and node (a /dev/shm segment file, as
deployed), and Mooncake's ``mooncake_master`` and storage process (1 GiB segment). Host
``h2`` runs one benchmark client of each (``benchmarks/store.py --phase ours-client`` /
``mooncake-client``), both over the transfer engine's TCP transport. After a warm-up round
each, their rounds alternate (a round: batch put then batch get of 64 MiB of 1 MiB values;
which goes first flips every pair), so a noisy neighbour on this shared machine hits both
alike. Figures: the median of each store's rounds, and per pair of adjacent rounds the
ratio ours/Mooncake's (its quartiles say how much to trust the ratio of medians).

A client's report is checked before anything counts: every byte crossed h2's veth (its
non-loopback interfaces received and sent at least the payload), and ours moved every byte
through its transfer engine and mapped no node segment, although it is given the node's
segment directory: the same-host shared-memory path must turn itself off across hosts
(common/host.py).
"""
from __future__ import annotations

import functools
import shutil
import statistics
import tempfile
import time
from typing import Any, Optional

from benchmarks import store as bench
from benchmarks.store_clients import TOTAL, ClientProc, Times, gbps, interleave
from launch.netns import TestBed, available

VALUE = 1 << 20
ROUNDS = 20  # timed rounds per store, after one warm-up round each
PREFIX, SUBNET = "cbench", "10.78.0"
OURS_BASE_PORT = 21540  # inside h1: master 21542, metrics 21544, events 21545, node 21550
MOONCAKE_PORT = 21530  # inside h1: mooncake_master RPC; its metrics on 21531
STORES = ("ours", "mooncake")


class CrossHostUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2): say why, measure nothing."""


def check_report(name: str, report: dict[str, Any], rounds: int) -> None:
    """Raise unless the client's bytes crossed its network interfaces (and, for ours,
    went through the transfer engine, no segment mapped). ``rounds``: all, warm-up too."""
    payload = rounds * TOTAL  # each way
    rx, tx = report["nic_bytes"]
    if tx < payload or rx < payload:
        raise RuntimeError(f"{name}: the client's interfaces sent {tx} and received {rx} "
                           f"bytes, less than the {payload} bytes put and got: the bytes "
                           f"did not cross hosts")
    if "engine_bytes" in report and (report["mapped"] or report["engine_bytes"] != 2 * payload):
        raise RuntimeError(f"{name}: the transfer engine moved {report['engine_bytes']} of "
                           f"{2 * payload} bytes; segments mapped: {report['mapped']} (the "
                           f"same-host shared-memory path was used across hosts)")


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def summarize(times: dict[str, Times]) -> dict[str, Any]:
    """GB/s (median) per store and op, and the quartiles of the per-pair ratios."""
    out: dict[str, Any] = {}
    for op, i in (("put", 0), ("get", 1)):
        ours, theirs = ([t[i] for t in times[name]] for name in STORES)
        out[op] = (gbps(ours), gbps(theirs))
        out[f"{op}_pair_ratios"] = quartiles([m / o for o, m in zip(ours, theirs)])
    return out


def bench_cross_host(rounds: int = ROUNDS, prefix: str = PREFIX,
                     subnet: str = SUBNET) -> dict[str, Any]:
    """``put``/``get``: (ours GB/s, Mooncake's GB/s); ``*_pair_ratios``: quartiles of
    ours/Mooncake's per pair. Raises ``CrossHostUnavailable`` where no bed can be made."""
    ok, why = available()
    if not ok:
        raise CrossHostUnavailable(why)
    shm_dir = tempfile.mkdtemp(prefix="crescent-bench-", dir="/dev/shm")
    try:
        with TestBed(2, prefix=prefix, subnet=subnet) as bed:
            server, here = bed.addresses["h1"], bed.addresses["h2"]
            masters = {"ours": f"tcp://{server}:{OURS_BASE_PORT + 2}",
                       "mooncake": f"{server}:{MOONCAKE_PORT}"}
            procs = bench.start_servers(functools.partial(bed.popen, "h1"), OURS_BASE_PORT,
                                        MOONCAKE_PORT, shm_dir, server)
            clients: dict[str, ClientProc] = {}
            try:
                for name in STORES:
                    clients[name] = ClientProc(bed.argv("h2", bench.phase_argv(
                        f"{name}-client", masters[name], here, shm_dir)))
                times = interleave(clients, VALUE, rounds)
                for name, client in clients.items():
                    check_report(name, client.finish(), rounds + 1)
            finally:
                for client in clients.values():
                    client.kill()
                bench.stop(procs)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    return summarize(times)


def cross_host_or_reason() -> tuple[Optional[dict[str, Any]], str]:
    """The cross-host figures, or None and why they could not be taken."""
    try:
        t0 = time.monotonic()
        out = bench_cross_host()
        out["seconds"] = time.monotonic() - t0
        return out, ""
    except CrossHostUnavailable as exc:
        return None, str(exc)
