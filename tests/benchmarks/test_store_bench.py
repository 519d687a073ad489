"""The store benchmark (benchmarks/store.py, store_hosts.py, store_clients.py): the checks
that a cross-host figure counts only bytes that crossed hosts through the transfer engine,
the pair statistics, the client driver's failures, and one short real cross-host run
(network namespaces; skipped where they cannot be made)."""
from __future__ import annotations

import sys

import pytest

from benchmarks import store_clients
from benchmarks.store_clients import TOTAL, ClientProc, interleave
from benchmarks.store_hosts import bench_cross_host, check_report, summarize
from launch.netns import available

GOOD = {"nic_bytes": [3 * TOTAL + 500, 3 * TOTAL + 900], "engine_bytes": 6 * TOTAL,
        "mapped": {}}


def test_a_report_whose_bytes_crossed_hosts_passes():
    check_report("ours", GOOD, rounds=3)
    check_report("mooncake", {"nic_bytes": GOOD["nic_bytes"]}, rounds=3)


@pytest.mark.parametrize("bad, why", [
    ({"nic_bytes": [3 * TOTAL, 3 * TOTAL - 1]}, "did not cross hosts"),  # sent too little
    ({"nic_bytes": [100, 3 * TOTAL]}, "did not cross hosts"),  # received too little
    ({"engine_bytes": 4 * TOTAL}, "transfer engine moved"),  # some bytes went around it
    ({"mapped": {"store_node-0": "/dev/shm/x"}}, "same-host shared-memory path"),
])
def test_a_report_that_did_not_cross_hosts_is_refused(bad, why):
    with pytest.raises(RuntimeError, match=why):
        check_report("ours", {**GOOD, **bad}, rounds=3)


class _Recorder:
    """A stand-in client that records the order of the rounds it is asked for."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def round(self, size: int) -> tuple[float, float]:
        self.log.append((self.name, size))
        return float(len(self.log)), 0.5


def test_interleave_warms_up_then_takes_turns_in_alternating_order():
    log: list = []
    clients = {n: _Recorder(n, log) for n in ("a", "b", "c")}
    times = interleave(clients, 7, rounds=3)  # type: ignore[arg-type]
    assert [n for n, _ in log] == ["a", "b", "c",  # warm-up, not timed
                                   "a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert {size for _, size in log} == {7}
    assert times == {"a": [(4.0, 0.5), (9.0, 0.5), (10.0, 0.5)],
                     "b": [(5.0, 0.5), (8.0, 0.5), (11.0, 0.5)],
                     "c": [(6.0, 0.5), (7.0, 0.5), (12.0, 0.5)]}


def test_summary_medians_and_pair_ratios():
    # ours: puts of 0.1 s and gets of 0.05 s; Mooncake's twice as slow, then as fast
    times = {"ours": [(0.1, 0.05), (0.1, 0.05), (0.1, 0.05), (0.1, 0.05)],
             "mooncake": [(0.2, 0.1), (0.2, 0.1), (0.1, 0.05), (0.1, 0.05)]}
    out = summarize(times)
    assert out["put"] == pytest.approx((TOTAL / 0.1 / 1e9, TOTAL / 0.15 / 1e9))
    assert out["get"] == pytest.approx((TOTAL / 0.05 / 1e9, TOTAL / 0.075 / 1e9))
    assert out["put_pair_ratios"] == pytest.approx((1.0, 1.5, 2.0))
    assert out["get_pair_ratios"] == pytest.approx((1.0, 1.5, 2.0))


def test_a_client_that_dies_is_reported_with_its_stderr():
    client = ClientProc([sys.executable, "-c", "import sys; sys.stderr.write('boom'); "
                         "sys.exit(3)", "--phase", "dying-client"])
    try:
        with pytest.raises(RuntimeError, match="dying-client exited: boom"):
            client.round(1 << 20)
    finally:
        client.kill()


def test_a_reply_that_arrives_with_other_output_is_found():
    # one write: a log line and the reply; then the client waits for more input
    script = ("import sys; sys.stdin.readline(); "
              "sys.stdout.write('log line\\n{\"put\": 0.5, \"get\": 0.25}\\n'); "
              "sys.stdout.flush(); sys.stdin.readline()")
    client = ClientProc([sys.executable, "-c", script, "--phase", "chatty-client"])
    try:
        assert client.round(1 << 20) == (0.5, 0.25)
    finally:
        client.kill()


def test_a_silent_client_misses_its_deadline(monkeypatch):
    monkeypatch.setattr(store_clients, "REPLY_S", 0.3)
    client = ClientProc([sys.executable, "-c", "import time; time.sleep(30)",
                         "--phase", "silent-client"])
    try:
        with pytest.raises(RuntimeError, match="silent-client did not answer within"):
            client.round(1 << 20)
    finally:
        client.kill()


@pytest.mark.e2e
def test_cross_host_run_counts_only_bytes_that_crossed_hosts():
    ok, why = available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    out = bench_cross_host(rounds=4, prefix="cbtest", subnet="10.78.1")
    for op in ("put", "get"):
        ours, theirs = out[op]
        assert ours > 0 and theirs > 0
        assert len(out[f"{op}_pair_ratios"]) == 3
