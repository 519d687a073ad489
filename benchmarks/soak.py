"""Soak: many requests at high concurrency on the default cluster; nothing lost, nothing
leaked, and the memory of every process flat once warmed up.

A real cluster from launch/configs/default.toml (the default model, ``crescent up``'s
supervisor on) serves ``--requests`` greedy chat requests from ``--concurrency`` clients
(benchmarks/fault_load.py: every outcome classified; half of them streamed) over
``--prompts`` distinct prompts. Meanwhile the resident memory (VmRSS, /proc) of every
cluster process is sampled every ``--sample`` seconds. Afterwards the pools must be idle
(``/debug/pools``: no referenced block) and no process may have been restarted.

Flat after warm-up: per process, the median RSS of the samples taken while the requests
``--warmup`` to ``--warmup`` + 10 % completed is compared with the median of the last
10 %; growth over ``--tolerance-mb`` is a fail, and so is a slope (MB per 1,000 requests,
least squares over the samples after warm-up) over ``--max-mb-per-1k``. ``inconsistent``
counts answers that differ from the first answer to the same prompt (greedy: expected 0;
informational).

``--tracemalloc [FRAMES]`` runs every process with tracemalloc (common/memtrace.py): a
baseline snapshot when the warm-up ends, and at the end each process's top growth sites,
printed and kept in ``<out>/tracemalloc/``. tracemalloc slows the processes and adds to
their RSS: take the RSS verdict from a run without it.

    python benchmarks/soak.py [--requests 2000] [--concurrency 32] [--max-tokens 32]
        [--prompts 200] [--http-port 20650] [--max-mb-per-1k 1.0] [--tracemalloc [10]]

Prints the outcome counts, one RSS row per process, and one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.fault_load import (  # noqa: E402
    Load, aligned, begin_run, prompts, tally, wait_idle,
)
from benchmarks.live_replay import cluster_config_data, to_toml  # noqa: E402
from common import memtrace  # noqa: E402
from common.memtrace import rss_mb  # noqa: E402
from launch.cluster import LocalCluster  # noqa: E402


@dataclass
class Sample:
    t: float  # seconds since the load started
    done: int  # requests finished by then
    rss: dict[str, float]  # process name -> MiB


class Sampler:
    """Samples every cluster child's RSS in a thread until ``stop``; calls ``at_warm``
    once, at the first sample with ``warm_at`` requests done."""

    def __init__(self, cluster: LocalCluster, load: Load, interval_s: float, warm_at: int,
                 at_warm: Optional[Callable[[], None]] = None) -> None:
        self.cluster, self.load, self.interval_s = cluster, load, interval_s
        self.warm_at, self.at_warm = warm_at, at_warm
        self.samples: list[Sample] = []
        self.pids: dict[str, set[int]] = {}
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        rss = {}
        for child in list(self.cluster.children):
            mb = rss_mb(child.proc.pid)
            if mb is not None:
                rss[child.name] = mb
                self.pids.setdefault(child.name, set()).add(child.proc.pid)
        done = len(self.load.outcomes)
        self.samples.append(Sample(round(time.monotonic() - self._t0, 1), done, rss))
        if self.at_warm is not None and done >= self.warm_at:
            self.at_warm()
            self.at_warm = None


@dataclass
class Memory:
    process: str
    start_mb: float
    warm_mb: float
    end_mb: float
    peak_mb: float
    growth_mb: float
    slope_mb_per_1k: float
    flat: bool
    restarted: bool


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (x, y) points (0 with fewer than two distinct x)."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    num = sum((x - mx) * (y - my) for x, y in points)
    return num / sum((x - mx) ** 2 for x in xs)


def memory(samples: list[Sample], pids: dict[str, set[int]], total: int, warmup: float,
           tolerance_mb: float, max_mb_per_1k: float) -> list[Memory]:
    """Per process: RSS after warm-up vs at the end (see the module doc)."""
    rows = []
    for name in sorted(pids):
        series = [(s.done, s.rss[name]) for s in samples if name in s.rss]
        if not series:
            continue
        warm = [mb for d, mb in series if warmup * total <= d <= (warmup + 0.1) * total]
        end = [mb for d, mb in series if d >= 0.9 * total]
        after = [(d / 1000, mb) for d, mb in series if d >= warmup * total]
        warm_mb = statistics.median(warm or [series[0][1]])
        end_mb = statistics.median(end or [series[-1][1]])
        growth, slope = end_mb - warm_mb, _slope(after)
        rows.append(Memory(name, round(series[0][1], 1), round(warm_mb, 1), round(end_mb, 1),
                           round(max(mb for _, mb in series), 1), round(growth, 1),
                           round(slope, 2), growth <= tolerance_mb and slope <= max_mb_per_1k,
                           len(pids[name]) > 1))
    return rows


async def soak(cluster: LocalCluster, args: argparse.Namespace) -> tuple[Load, Sampler]:
    load = Load(cluster.url, prompts(args.prompts), args.concurrency, args.max_tokens,
                args.deadline, limit=args.requests)
    warm_at = int(args.warmup * args.requests)
    sampler = Sampler(cluster, load, args.sample, warm_at,
                      (lambda: signal_children(cluster)) if args.tracemalloc else None)
    sampler.start()
    runner = asyncio.create_task(load.run(asyncio.Event()))
    while not runner.done():
        await asyncio.wait([runner], timeout=30)
        print(f"[{datetime.now().strftime('%H:%M:%S')}] {len(load.outcomes)}/{args.requests}"
              f" done", file=sys.stderr, flush=True)
    await runner
    sampler.stop()
    return load, sampler


def signal_children(cluster: LocalCluster) -> float:
    """SIGUSR2 to every child: a tracemalloc snapshot (common/memtrace.py). Returns when."""
    sent = time.time()
    for child in list(cluster.children):
        try:
            os.kill(child.proc.pid, signal.SIGUSR2)
        except ProcessLookupError:
            pass
    return sent


def growth_sites(cluster: LocalCluster, folder: Path, timeout_s: float = 120.0) -> dict:
    """The last snapshot of every child: its report (by name), once written."""
    sent = signal_children(cluster)
    names = [child.name for child in cluster.children]
    reports: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(reports) < len(names) and time.monotonic() < deadline:
        for name in names:
            path = folder / f"{name}{memtrace.SUFFIX}"
            if name not in reports and path.exists() and path.stat().st_mtime >= sent:
                reports[name] = path.read_text()
        time.sleep(0.5)
    return reports


def inconsistent(load: Load) -> int:
    first: dict[int, str] = {}
    bad = 0
    for o in load.outcomes:
        if o.kind == "ok":
            bad += first.setdefault(o.prompt, o.text) != o.text
    return bad


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=200, help="distinct prompts")
    p.add_argument("--deadline", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--sample", type=float, default=2.0, help="RSS sampling period, seconds")
    p.add_argument("--warmup", type=float, default=0.25, help="fraction of the requests")
    p.add_argument("--tolerance-mb", type=float, default=64.0)
    p.add_argument("--max-mb-per-1k", type=float, default=1.0,
                   help="the most RSS growth per 1,000 requests after warm-up (the slope)")
    p.add_argument("--tracemalloc", type=int, nargs="?", const=10, default=0, metavar="FRAMES",
                   help="report each process's top growth sites (see the module doc)")
    p.add_argument("--http-port", type=int, default=20650,
                   help="router HTTP port; the cluster's inboxes start at +10")
    p.add_argument("--out", default=None, help="default: out/soak/<UTC time>")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or not 0 <= args.warmup < 0.9:
        p.error("--requests and --concurrency must be >= 1, --warmup in [0, 0.9)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started, out = begin_run("soak", args.out, REPO)
    cfg = out / "cluster.toml"
    cfg.write_text(to_toml(cluster_config_data("disagg-store", args.http_port)))
    traces = out / "tracemalloc"
    if args.tracemalloc:  # the children inherit the environment
        os.environ.update({memtrace.ENV_FRAMES: str(args.tracemalloc),
                           memtrace.ENV_DIR: str(traces)})
    cluster = LocalCluster(str(cfg), out / "logs")
    try:
        cluster.start(timeout_s=180)
        cluster.supervise_in_background()
        t0 = time.monotonic()
        load, sampler = asyncio.run(soak(cluster, args))
        wall = time.monotonic() - t0
        workers = sum(r in ("prefill", "decode") for r, _ in cluster.plan())
        leaked, _ = asyncio.run(wait_idle(cluster.url, workers, 30.0))
        restarts = {f"{r}-{i}": n for (r, i), n in cluster.restarts.items() if n}
        sites = growth_sites(cluster, traces) if args.tracemalloc else {}
    finally:
        cluster.stop()
    counts = tally(load.outcomes, None)
    counts.pop("wrong")
    mem = memory(sampler.samples, sampler.pids, args.requests, args.warmup, args.tolerance_mb,
                 args.max_mb_per_1k)
    for name, text in sorted(sites.items()):
        print(f"--- {name}: growth since warm-up (tracemalloc)\n{text}")
    summary = dict(counts, leaked=leaked, inconsistent=inconsistent(load),
                   restarts=restarts, wall_s=round(wall, 1),
                   req_per_s=round(len(load.outcomes) / wall, 2),
                   rss_flat=all(m.flat for m in mem))
    print(" ".join(f"{k}={v}" for k, v in summary.items()))
    rows = [list(asdict(mem[0]))] if mem else []
    print(aligned(rows + [[str(v) for v in asdict(m).values()] for m in mem]))
    (out / "rss_samples.json").write_text(json.dumps([asdict(s) for s in sampler.samples]))
    print(json.dumps({"bench": "soak", "started": started.isoformat(timespec="seconds"),
                      "requests": args.requests, "concurrency": args.concurrency,
                      "max_tokens": args.max_tokens, "prompts": args.prompts,
                      "tolerance_mb": args.tolerance_mb, "max_mb_per_1k": args.max_mb_per_1k,
                      "tracemalloc": args.tracemalloc, "out": str(out), **summary,
                      "memory": [asdict(m) for m in mem]}))
    ok = (counts["lost"] == counts["unclear"] == 0 and leaked == 0 and not restarts
          and summary["rss_flat"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
