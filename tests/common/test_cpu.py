"""Per-role core sets and thread counts: parsing, default splits, overrides, applying."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ClusterConfig
from common.cpu import (
    CpuConfig, CpuError, CpuPlan, default_pools, format_cpu_list, parse_cpu_list, plan_cores,
    plan_env, plan_from_env, share,
)

REPO = Path(__file__).resolve().parents[2]
DISAGG = [("store_master", 0), ("store_node", 0), ("conductor", 0), ("prefill", 0),
          ("decode", 0), ("router", 0)]


def test_parse_and_format_round_trip() -> None:
    assert parse_cpu_list("0-3,8") == (0, 1, 2, 3, 8)
    assert parse_cpu_list("5, 1,1-2") == (1, 2, 5)
    assert parse_cpu_list("7") == (7,)
    assert format_cpu_list((0, 1, 2, 3, 8)) == "0-3,8"
    assert format_cpu_list([5, 1, 2]) == "1-2,5"
    assert format_cpu_list([4]) == "4"
    assert format_cpu_list([]) == ""


@pytest.mark.parametrize("text, message", [
    ("", "'' is not a core"),
    ("a", "'a' is not a core"),
    ("1-", "'1-' is not a core"),
    ("3-1", "bad range '3-1'"),
    ("-1", "'-1' is not a core"),
    ("0,,2", "'' is not a core"),
])
def test_parse_rejects_bad_lists(text: str, message: str) -> None:
    with pytest.raises(CpuError, match=message):
        parse_cpu_list(text)


def test_default_pools_by_core_count() -> None:
    roles = ["prefill", "decode", "router"]
    assert default_pools([0], roles) == {
        "prefill": (0,), "decode": (0,), "colocated": (0,), "service": (0,)}
    # Two cores: prefill has its core alone; services share the decode side's.
    assert default_pools([0, 1], roles) == {
        "prefill": (0,), "decode": (1,), "colocated": (0, 1), "service": (1,)}
    assert default_pools([0, 1, 2], roles) == {
        "prefill": (0, 1), "decode": (2,), "colocated": (0, 1, 2), "service": (2,)}
    # Four or more: the last N // 8 cores (at least one) belong to the services alone.
    assert default_pools([0, 1, 2, 3], roles) == {
        "prefill": (0, 1), "decode": (2,), "colocated": (0, 1, 2), "service": (3,)}
    assert default_pools(range(16), roles) == {
        "prefill": tuple(range(7)), "decode": tuple(range(7, 14)),
        "colocated": tuple(range(14)), "service": (14, 15)}
    # Only one compute role running (a colocated cluster): it gets every compute core.
    assert default_pools([2, 3, 4, 5], ["colocated", "router"])["colocated"] == (2, 3, 4)
    with pytest.raises(CpuError, match="no CPU cores"):
        default_pools([], roles)


def test_share_divides_a_pool_among_workers() -> None:
    pool = (0, 1, 2, 3, 4)
    assert [share(pool, i, 2) for i in range(2)] == [(0, 1, 2), (3, 4)]
    assert [share(pool, i, 3) for i in range(3)] == [(0, 1), (2, 3), (4,)]
    assert [share(pool, i, 1) for i in range(1)] == [pool]
    # Fewer cores than workers: single cores, round-robin.
    assert [share((6, 7), i, 3) for i in range(3)] == [(6,), (7,), (6,)]


def test_plan_two_cores_default() -> None:
    plans = plan_cores(DISAGG, CpuConfig(), [0, 1])
    assert plans == {
        ("store_master", 0): CpuPlan((1,), 1), ("store_node", 0): CpuPlan((1,), 1),
        ("conductor", 0): CpuPlan((1,), 1), ("prefill", 0): CpuPlan((0,), 1),
        ("decode", 0): CpuPlan((1,), 1), ("router", 0): CpuPlan((1,), 1)}


def test_plan_eight_cores_two_workers_per_role() -> None:
    procs = DISAGG + [("prefill", 1), ("decode", 1)]
    plans = plan_cores(procs, CpuConfig(decode_threads=2), range(8))
    # compute = 0-6 (7 cores): prefill 0-3, decode 4-6; services 7.
    assert plans[("prefill", 0)] == CpuPlan((0, 1), 2)
    assert plans[("prefill", 1)] == CpuPlan((2, 3), 2)
    assert plans[("decode", 0)] == CpuPlan((4, 5), 2)
    assert plans[("decode", 1)] == CpuPlan((6,), 2)  # explicit threads win over core count
    assert plans[("router", 0)] == CpuPlan((7,), 1)


def test_plan_colocated_gets_all_compute_cores() -> None:
    procs = [("conductor", 0), ("colocated", 0), ("router", 0)]
    assert plan_cores(procs, CpuConfig(), [0, 1])[("colocated", 0)] == CpuPlan((0, 1), 2)
    assert plan_cores(procs, CpuConfig(), range(4))[("colocated", 0)] == CpuPlan((0, 1, 2), 3)


def test_explicit_core_lists_override_one_role() -> None:
    cfg = CpuConfig(prefill_cores="0-1", service_cores="0")
    plans = plan_cores(DISAGG, cfg, range(4))
    assert plans[("prefill", 0)] == CpuPlan((0, 1), 2)
    assert plans[("decode", 0)] == CpuPlan((2,), 1)  # still the default
    assert plans[("router", 0)] == CpuPlan((0,), 1)


def test_unavailable_cores_are_a_clear_error() -> None:
    with pytest.raises(CpuError, match=r"cpu.decode_cores = '2-5' names cores 2-5 this "
                                       r"process may not use \(available: 0-1\)"):
        plan_cores(DISAGG, CpuConfig(decode_cores="2-5"), [0, 1])


def test_affinity_off_pins_nothing_but_keeps_the_thread_counts() -> None:
    plans = plan_cores(DISAGG, CpuConfig(affinity=False), [0, 1])
    assert plans[("prefill", 0)] == plans[("decode", 0)] == CpuPlan((0, 1), 1)
    assert plans[("router", 0)] == CpuPlan((0, 1), 1)
    solo = plan_cores([("colocated", 0)], CpuConfig(affinity=False), range(4))
    assert solo[("colocated", 0)] == CpuPlan((0, 1, 2, 3), 3)
    explicit = plan_cores(DISAGG, CpuConfig(affinity=False, decode_threads=3), range(4))
    assert explicit[("decode", 0)] == CpuPlan((0, 1, 2, 3), 3)


def test_config_validation() -> None:
    with pytest.raises(CpuError, match="cpu.prefill_cores '1-x'"):
        CpuConfig(prefill_cores="1-x")
    with pytest.raises(CpuError, match="cpu.decode_threads must be a positive integer"):
        CpuConfig(decode_threads=0)
    cfg = ClusterConfig.from_dict({"cpu": {"prefill_cores": "0", "prefill_threads": 3}})
    assert cfg.cpu == CpuConfig(prefill_cores="0", prefill_threads=3)
    assert cfg.cpu.threads("prefill") == 3 and cfg.cpu.threads("router") is None
    assert ClusterConfig.from_dict(cfg.to_dict()).cpu == cfg.cpu
    with pytest.raises(ValueError, match=r"unknown config keys in \[cpu\]: \['bogus'\]"):
        ClusterConfig.from_dict({"cpu": {"bogus": 1}})


def test_env_round_trip() -> None:
    env = plan_env(CpuPlan((0, 1, 2, 3, 8), 4))
    assert env == {"CRESCENT_CPUS": "0-3,8", "CRESCENT_THREADS": "4",
                   "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"}
    assert plan_from_env(env) == CpuPlan((0, 1, 2, 3, 8), 4)
    assert plan_from_env({}) is None
    assert plan_from_env({"CRESCENT_CPUS": "1"}) == CpuPlan((1,), 1)
    with pytest.raises(CpuError, match="CRESCENT_THREADS must be positive"):
        plan_from_env({"CRESCENT_CPUS": "1", "CRESCENT_THREADS": "0"})


def _apply_in_child(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = ("import os, torch\n"
            "from common.cpu import apply_from_env\n"
            "apply_from_env('probe', torch_threads=True)\n"
            "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(),"
            " os.environ.get('OMP_NUM_THREADS'))\n")
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_apply_from_env_pins_a_real_process() -> None:
    core = max(os.sched_getaffinity(0))
    env = dict(os.environ, PYTHONPATH=str(REPO), CRESCENT_CPUS=str(core),
               CRESCENT_THREADS="3")
    out = _apply_in_child(env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[{core}] 3 3"
    assert f"probe: cpu plan applied: cores {core}, 3 torch thread(s)" in out.stderr


def test_apply_from_env_unavailable_core_fails_clearly() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), CRESCENT_CPUS="4095")
    out = _apply_in_child(env)
    assert out.returncode != 0
    assert "CpuError: probe: cannot pin to cores 4095" in out.stderr
