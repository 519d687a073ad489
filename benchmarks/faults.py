"""Fault injection: a real cluster under steady greedy load while each role is SIGKILLed.

One cluster (launch/cluster.py:LocalCluster, small pools, the store on) is started; a
fault-free reference answer is taken for every prompt; then, for each fault in turn, a
steady stream of requests runs (benchmarks/fault_load.py) while the harness SIGKILLs one
process; the cluster's own supervisor (``LocalCluster.supervise_in_background``, what
``crescent up`` runs) starts it again after its back-off. The load goes on until a request
sent after the kill succeeds (recovery) and ``--phase`` seconds more; then the harness
waits for every request to end and checks the pools.

Per fault: completed, failed (with a clear error), unclear (an error without a message or
a stream cut without one), lost (no answer and no error within the request deadline),
wrong (answers that differ from the reference), leaked (KV blocks still referenced once
idle, from ``/debug/pools``), missing (workers not registered again), orphans (shared
memory segment files of this cluster's dead processes still on disk), recovery (kill →
first success of a request sent after it), and which other processes the supervisor had
to restart meanwhile (a cascade).
The first row, ``none``, is the same load with nothing killed: the control.

    python benchmarks/faults.py [--faults none,decode,prefill,store_node,store_master,conductor]
        [--phase 6] [--concurrency 4] [--max-tokens 16] [--http-port 20700]

Prints one table and ends with one JSON line. tests/faults/ runs the same with a short
phase and asserts lost == wrong == leaked == 0.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.fault_load import (  # noqa: E402
    Load, aligned, begin_run, prompts, reference_answers, tally, wait_healthy, wait_idle,
    wrong,
)
from benchmarks.live_replay import to_toml  # noqa: E402
from common.store.shm import pid_alive  # noqa: E402
from launch.cluster import LocalCluster  # noqa: E402
from launch.forkserver import ForkServer  # noqa: E402

FAULTS = ["none", "decode", "prefill", "store_node", "store_master", "conductor"]
# with prefill_stages > 1 also: a later stage of prefill group 0 (process 1)
STAGE_FAULT = "prefill_stage"

def config_data(http: int, prefill: int, decode: int, scheduler: str,
                router_timeout: float, stages: int = 1) -> dict:
    """Small pools, the store on, fast heartbeats (a dead worker is noticed in 2 s), a
    short KV wait (an orphaned reservation is freed in 10 s) and quick restarts."""
    return {"model": "smollm2-135m", "http_port": http, "base_port": http + 10,
            "prefill_workers": prefill, "prefill_stages": stages, "decode_workers": decode,
            "prefill_blocks": 256, "decode_blocks": 512, "scheduler": scheduler,
            "cost_profile": "cpu-smollm2-135m",  # faults, not predictions: no calibration
            "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0,
            "kv_wait_timeout_s": 10.0, "request_timeout_s": router_timeout,
            "supervise": {"backoff_s": 0.5, "max_restarts_per_minute": 20},
            "store": {"enabled": True, "segment_bytes": 64 << 20,
                      "register_deadline_s": 30.0},
            "slo": {"ttft_s": 120.0, "tbt_s": 30.0}}


@dataclass
class Timing:
    """Seconds. ``phase``: load after recovery; ``recover``: the most to wait for it."""

    warm: float = 2.0
    phase: float = 6.0
    recover: float = 60.0
    deadline: float = 30.0  # per request
    idle: float = 20.0  # for the pools to be idle once the load stopped


@dataclass
class FaultResult:
    fault: str
    completed: int
    failed: int
    unclear: int
    lost: int
    wrong: int
    leaked: int
    missing: int
    orphans: int
    recovery_s: Optional[float]
    exited: list[str] = field(default_factory=list)  # others the supervisor restarted
    errors: list[str] = field(default_factory=list)  # the commonest failure details
    wrong_examples: list[str] = field(default_factory=list)  # got vs expected, the first 2


def write_config(workdir: Path, http: int, prefill: int = 1, decode: int = 1,
                 scheduler: str = "kvcache_centric", router_timeout: float = 60.0,
                 stages: int = 1) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "cluster.toml"
    path.write_text(to_toml(config_data(http, prefill, decode, scheduler, router_timeout,
                                        stages)))
    return path


def target(cluster: LocalCluster, fault: str) -> Optional[tuple[str, int]]:
    """The (role, index) a fault kills: instance 0 of the role (None for ``none``)."""
    if fault == "none":
        return None
    if fault == STAGE_FAULT:
        if cluster.config.prefill_stages < 2:
            raise ValueError(f"fault {fault!r} needs prefill_stages > 1")
        return "prefill", 1
    roles = {role for role, _ in cluster.plan()}
    if fault not in roles:
        raise ValueError(f"fault {fault!r} names no process of this cluster ({sorted(roles)})")
    return fault, 0


KV_SHM_DIR = "/dev/shm"  # workers' KV segments (common/kv/shm_kv.py SHM_DIR)
_OWNER = re.compile(r"^crescent-.+-(\d+)$")  # common/store/shm.py names: ...-<pid>


def orphan_segments(cluster: LocalCluster, pids: set[int]) -> list[str]:
    """Segment files (store nodes', workers' KV) whose owner is a dead process of this
    cluster: what a killed process left and nobody cleaned."""
    dirs = {KV_SHM_DIR, cluster.config.store.shm_dir or KV_SHM_DIR}
    found = []
    for d in sorted(dirs):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            m = _OWNER.match(name)
            if m and int(m.group(1)) in pids and not pid_alive(int(m.group(1))):
                found.append(os.path.join(d, name))
    return found


async def lasting_orphans(cluster: LocalCluster, pids: set[int], wait_s: float) -> list[str]:
    """Orphaned segments still there after ``wait_s``: a restarted process sweeps its dead
    predecessor's files when it creates its own, which a later pipeline stage (not a
    registered instance, so not awaited by ``wait_idle``) may not have done yet."""
    give_up = time.monotonic() + wait_s
    while True:
        found = orphan_segments(cluster, pids | child_pids(cluster))
        if not found or time.monotonic() > give_up:
            return found
        await asyncio.sleep(0.2)


def child_pids(cluster: LocalCluster) -> set[int]:
    return {c.proc.pid for c in list(cluster.children)}


async def run_fault(cluster: LocalCluster, fault: str, questions: list[str],
                    reference: list[str], timing: Timing, concurrency: int,
                    max_tokens: int) -> FaultResult:
    """One fault under load; the cluster's supervisor (``supervise_in_background``)
    restarts the killed process, and any other that exits because of it."""
    kill = target(cluster, fault)
    load = Load(cluster.url, questions, concurrency, max_tokens, timing.deadline)
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(stop))
    await asyncio.sleep(timing.warm)
    before = dict(cluster.restarts)
    pids = child_pids(cluster)
    t_kill = time.monotonic()
    if kill is not None:
        await asyncio.to_thread(cluster.kill, *kill)
        await asyncio.to_thread(cluster.wait_restarted, *kill, timing.recover,
                                before.get(kill, 0))
    give_up = time.monotonic() + timing.recover
    while load.first_ok_sent_after(t_kill) is None and time.monotonic() < give_up:
        await asyncio.sleep(0.2)
    first = load.first_ok_sent_after(t_kill)
    await asyncio.sleep(timing.phase)
    stop.set()
    outcomes = await runner
    await wait_healthy(cluster.url, timing.recover)
    c = cluster.config  # the instances that register (a prefill group is one)
    workers = (c.colocated_workers if c.mode == "colocated"
               else c.prefill_workers + c.decode_workers)
    leaked, instances = await wait_idle(cluster.url, workers, timing.idle)
    orphans = await lasting_orphans(cluster, pids, timing.idle)
    counts = tally(outcomes, reference)
    errors = Counter(o.detail[:100] for o in outcomes if o.kind != "ok")
    exited = [f"{role}-{i}" for (role, i), n in cluster.restarts.items()
              if n > before.get((role, i), 0) + ((role, i) == kill)]
    return FaultResult(
        fault=fault, completed=counts["ok"], failed=counts["failed"],
        unclear=counts["unclear"], lost=counts["lost"], wrong=counts["wrong"],
        leaked=leaked, missing=max(0, workers - len(instances)), orphans=len(orphans),
        recovery_s=None if first is None else round(first.done - t_kill, 2),
        exited=sorted(exited), errors=[f"{n}x {d}" for d, n in errors.most_common(3)],
        wrong_examples=[f"prompt {o.prompt} ({o.kind}): {o.text!r} != {reference[o.prompt]!r}"
                        for o in outcomes if wrong(o, reference[o.prompt])][:2])


def run(workdir: Path, http_port: int, faults: list[str], timing: Timing,
        concurrency: int = 4, max_tokens: int = 16, n_prompts: int = 16, prefill: int = 1,
        decode: int = 1, scheduler: str = "kvcache_centric", stages: int = 1,
        forkserver: Optional[ForkServer] = None) -> "Run":
    """Start a cluster, take the reference, inject ``faults`` in order, stop the cluster.
    ``forkserver``: fork the cluster's processes from it (the tests; launch/forkserver.py)."""
    for fault in faults:
        if fault not in FAULTS + [STAGE_FAULT]:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    cfg = write_config(workdir, http_port, prefill, decode, scheduler,
                       router_timeout=timing.deadline * 2, stages=stages)
    cluster = LocalCluster(str(cfg), workdir / "logs", forkserver=forkserver)
    questions = prompts(n_prompts)
    results: list[FaultResult] = []
    pids: set[int] = set()
    try:
        cluster.start(timeout_s=180)
        cluster.supervise_in_background()
        reference = reference_answers(cluster.url, questions, max_tokens)
        for fault in faults:
            asyncio.run(wait_healthy(cluster.url, timing.recover))
            if cluster.failure is not None:  # the supervisor gave up (a crash loop)
                raise cluster.failure
            pids |= child_pids(cluster)
            results.append(asyncio.run(run_fault(cluster, fault, questions, reference,
                                                 timing, concurrency, max_tokens)))
            print(f"[{datetime.now().strftime('%H:%M:%S')}] {row_text(results[-1])}",
                  file=sys.stderr, flush=True)
        pids |= child_pids(cluster)
    finally:
        cluster.stop()
    return Run(results, orphan_segments(cluster, pids))


@dataclass
class Run:
    results: list[FaultResult]
    left_after_stop: list[str]  # segment files of this cluster still there once it stopped


# --------------------------------------------------------------------------- output
COLUMNS = ["fault", "completed", "failed", "unclear", "lost", "wrong", "leaked", "missing",
           "orphans", "recovery s", "exited"]


def cells(r: FaultResult) -> list[str]:
    rec = "-" if r.recovery_s is None else f"{r.recovery_s:.2f}"
    if r.recovery_s is None and r.fault != "none":
        rec = "never"
    return [r.fault, str(r.completed), str(r.failed), str(r.unclear), str(r.lost),
            str(r.wrong), str(r.leaked), str(r.missing), str(r.orphans), rec,
            ",".join(r.exited) or "-"]


def row_text(r: FaultResult) -> str:
    return " ".join(f"{k}={v}" for k, v in zip(COLUMNS, cells(r)))


def table(results: list[FaultResult]) -> str:
    return aligned([COLUMNS] + [cells(r) for r in results])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--phase", type=float, default=6.0, help="load seconds after recovery")
    p.add_argument("--warm", type=float, default=2.0, help="load seconds before the kill")
    p.add_argument("--deadline", type=float, default=30.0, help="per request, seconds")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--scheduler", default="kvcache_centric")
    p.add_argument("--http-port", type=int, default=20700,
                   help="router HTTP port; the cluster's inboxes start at +10")
    p.add_argument("--out", default=None, help="default: out/faults/<UTC time>")
    args = p.parse_args(argv)
    args.fault_list = [f for f in args.faults.split(",") if f]
    unknown = [f for f in args.fault_list if f not in FAULTS]
    if unknown or not args.fault_list:
        p.error(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started, out = begin_run("faults", args.out, REPO)
    timing = Timing(warm=args.warm, phase=args.phase, deadline=args.deadline)
    done = run(out, args.http_port, args.fault_list, timing, args.concurrency,
               args.max_tokens, args.prompts, args.prefill, args.decode, args.scheduler)
    results = done.results
    print(table(results))
    for r in results:
        for err in r.errors + r.wrong_examples:
            print(f"  {r.fault}: {err}")
    print(f"segment files left after the cluster stopped: {len(done.left_after_stop)}")
    print(json.dumps({"bench": "faults", "started": started.isoformat(timespec="seconds"),
                      "timing": asdict(timing), "concurrency": args.concurrency,
                      "max_tokens": args.max_tokens, "prefill": args.prefill,
                      "decode": args.decode, "scheduler": args.scheduler, "logs": str(out),
                      "results": [asdict(r) for r in results],
                      "left_after_stop": done.left_after_stop}))
    bad = done.left_after_stop or any(r.lost or r.wrong or r.leaked or r.unclear
                                      or r.missing or r.orphans for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
