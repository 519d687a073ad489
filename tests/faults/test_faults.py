"""A real cluster under a steady greedy load while each role is SIGKILLed and restarted by
the cluster's supervisor (benchmarks/faults.py, short phases). For every fault: nothing
lost, no wrong output, no leaked KV block, every error clear, every worker back, and the
cluster serving again. The ``none`` row is the control: the same load, nothing killed.

Two prefill workers: a prefill worker's death is then invisible to clients (its requests
re-run on the other one); with one decode worker, its death fails requests, clearly."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.faults import FAULTS, FaultResult, Run, Timing, run, table
from launch import forkserver

pytestmark = pytest.mark.e2e
HTTP_PORT = 20600  # this file's ports: 20600-20629


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Run:
    workdir: Path = tmp_path_factory.mktemp("faults")
    done = run(workdir, HTTP_PORT, FAULTS, Timing(warm=1.0, phase=1.0), concurrency=3,
               max_tokens=12, n_prompts=12, prefill=2, forkserver=forkserver.shared())
    print("\n" + table(done.results))
    return done


@pytest.fixture(scope="module")
def results(measured: Run) -> dict[str, FaultResult]:
    return {r.fault: r for r in measured.results}


CASES = FAULTS


@pytest.mark.parametrize("fault", CASES)
def test_fault_loses_nothing_and_corrupts_nothing(results: dict[str, FaultResult],
                                                  fault: str) -> None:
    r = results[fault]
    assert r.lost == 0, r
    assert r.wrong == 0, r
    assert r.leaked == 0, r
    assert r.unclear == 0, r  # every failure told the client why
    assert r.missing == 0, r  # every worker registered again
    assert r.orphans == 0, r  # the killed process's shared memory file was cleaned
    assert r.recovery_s is not None, r  # a request sent after the kill succeeded
    assert r.completed > 0, r
    if fault in ("none", "prefill"):
        assert r.failed == 0, r


def test_no_segment_file_left_once_the_cluster_stopped(measured: Run) -> None:
    assert measured.left_after_stop == []
