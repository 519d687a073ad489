"""Core sets are applied: every thread of every process of a real cluster runs on its
role's cores (prefill and decode apart), with the planned thread counts."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from common.cpu import format_cpu_list
from launch.cluster import LocalCluster
from tests.e2e.conftest import start_cluster

pytestmark = pytest.mark.e2e

AVAILABLE = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def pinned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if len(AVAILABLE) < 2:
        pytest.skip("one CPU core: there is nothing to isolate prefill from decode on")
    c = start_cluster(tmp_path_factory.mktemp("cpu"), http=19900, base=19910, pinned=True)
    yield c
    c.stop()


def _thread_affinities(pid: int) -> dict[int, set[int]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            pass  # a thread that just ended
    return out


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def test_every_thread_runs_on_its_roles_cores(pinned: LocalCluster) -> None:
    # One request first, so the compute threads (OpenMP pools, the decode executor,
    # transfer-engine threads) exist when we look.
    r = httpx.post(pinned.url + "/v1/completions", timeout=120, json={
        "model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0})
    assert r.status_code == 200, r.text
    expected: dict[str, set[int]] = {}
    for child in pinned.children:
        plan = pinned.cpu_plan(child.role, child.index)
        assert plan is not None
        expected[child.name] = set(plan.cores)
        threads = _thread_affinities(child.proc.pid)
        assert len(threads) >= 1
        wrong = {tid: cores for tid, cores in threads.items() if cores != set(plan.cores)}
        assert not wrong, f"{child.name}: threads off their cores {plan.cores}: {wrong}"
        env = _environ(child.proc.pid)
        assert env["CRESCENT_CPUS"] == format_cpu_list(plan.cores)
        assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(plan.threads)
        log = child.log_path.read_text(errors="replace")
        want = (f"{child.role}: cpu plan applied: cores {format_cpu_list(plan.cores)}, "
                f"{plan.threads} {'torch ' if child.role in ('prefill', 'decode') else ''}"
                f"thread(s)")
        assert want in log, f"{child.name} log lacks {want!r}"
    assert not expected["prefill-0"] & expected["decode-0"]
    if len(AVAILABLE) == 2:  # this machine: the exact default split
        first, second = AVAILABLE
        assert expected == {"store_master-0": {second}, "store_node-0": {second},
                            "conductor-0": {second}, "prefill-0": {first},
                            "decode-0": {second}, "router-0": {second}}


def test_torch_threads_match_the_plan(pinned: LocalCluster) -> None:
    for child in pinned.children:
        if child.role not in ("prefill", "decode"):
            continue
        plan = pinned.cpu_plan(child.role, child.index)
        assert plan is not None
        found = re.findall(r"cpu plan applied: cores \S+, (\d+) torch thread",
                           child.log_path.read_text(errors="replace"))
        assert found == [str(plan.threads)], (child.name, found)
        assert plan.threads == len(plan.cores)
