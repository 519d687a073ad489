"""Faults in a prefill group (chunked pipeline parallelism) under load: SIGKILL of a later
stage, of the head, or of the decode worker every stage writes to. The group restarts as
one (a follower that loses its head exits; a head that loses a follower exits), so its
requests re-run on the other group through the conductor like any lost prefill worker's:
nothing lost, nothing wrong, no leaked block. A dead decode worker fails its requests
(with one decode worker there is nowhere else to go), clearly, and every stage's
streams to it end without leaking a block anywhere."""
from __future__ import annotations

import pytest

from benchmarks.faults import STAGE_FAULT, Timing, run, table
from launch import forkserver

pytestmark = pytest.mark.e2e
HTTP_PORT = 24400  # this file's ports: 24400-24429


def test_a_dead_stage_loses_nothing_and_leaks_nothing(tmp_path_factory) -> None:
    done = run(tmp_path_factory.mktemp("cpp-faults"), HTTP_PORT, [STAGE_FAULT, "prefill", "decode"],
               Timing(warm=1.0, phase=1.0), concurrency=3, max_tokens=12, n_prompts=12,
               prefill=2, stages=2, forkserver=forkserver.shared())
    print("\n" + table(done.results))
    for r in done.results:
        if r.fault != "decode":
            assert r.failed == 0, r
        assert (r.lost, r.wrong, r.leaked, r.unclear, r.missing, r.orphans) == (0,) * 6, r
        assert r.recovery_s is not None and r.completed > 0, r
    assert done.left_after_stop == []
