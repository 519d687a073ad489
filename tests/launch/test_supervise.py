"""Supervision: the pure restart policy, and LocalCluster restarting fake short-lived
children (``python -c``) with back-off, a crash-loop limit and appended logs."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from common.config import ClusterConfig, SuperviseConfig
from launch.cluster import ClusterError, LocalCluster
from launch.supervise import GiveUp, Restart, RestartPolicy


def policy(**kw: object) -> RestartPolicy:
    return RestartPolicy(SuperviseConfig(**{"backoff_s": 0.5, "max_backoff_s": 3.0,
                                            "max_restarts_per_minute": 4, **kw}))


def test_backoff_doubles_per_recent_restart_and_is_capped() -> None:
    p = policy()
    delays = [p.on_exit("decode-0", 1, t) for t in (0.0, 1.0, 2.0, 3.0)]
    assert delays == [Restart("decode-0", 1, 1, 0.5), Restart("decode-0", 1, 2, 1.0),
                      Restart("decode-0", 1, 3, 2.0), Restart("decode-0", 1, 4, 3.0)]


def test_a_fifth_exit_within_a_minute_is_a_crash_loop() -> None:
    p = policy()
    for t in range(4):
        assert isinstance(p.on_exit("conductor-0", -9, float(t)), Restart)
    out = p.on_exit("conductor-0", -9, 10.0)
    assert isinstance(out, GiveUp) and "crash loop: restarted 4 times" in out.reason
    assert "max_restarts_per_minute = 4" in str(out)


def test_old_restarts_leave_the_window_and_children_count_apart() -> None:
    p = policy()
    for t in range(4):
        p.on_exit("prefill-0", 1, float(t))
    assert p.on_exit("prefill-1", 1, 5.0) == Restart("prefill-1", 1, 1, 0.5)
    # 60 s after the first two restarts, two remain in the window: back-off 2 * 2 * 0.5
    assert p.on_exit("prefill-0", 1, 61.5) == Restart("prefill-0", 1, 5, 2.0)


def test_bad_config_and_restart_off_give_up_at_once() -> None:
    assert isinstance(policy().on_exit("router-0", 2, 0.0), GiveUp)
    out = policy(restart=False).on_exit("router-0", 0, 0.0)
    assert isinstance(out, GiveUp) and "restart = false" in out.reason


def test_supervise_table_is_validated() -> None:
    with pytest.raises(ValueError, match="backoff_s"):
        ClusterConfig.from_dict({"supervise": {"backoff_s": 5.0, "max_backoff_s": 1.0}})
    with pytest.raises(ValueError, match=r"unknown config keys in \[supervise\]"):
        ClusterConfig.from_dict({"supervise": {"retries": 3}})


class ScriptedCluster(LocalCluster):
    """A LocalCluster whose children are ``python -c CODE`` (role-specific)."""

    code: dict[str, str] = {}

    def command(self, role: str, index: int) -> list[str]:
        return [sys.executable, "-c", self.code.get(role, "import time; time.sleep(60)")]


def scripted(tmp_path: Path, code: dict[str, str], **supervise: object) -> ScriptedCluster:
    table = "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in supervise.items())
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[store]\nenabled = false\n[cpu]\naffinity = false\n"
                   f"[supervise]\n{table}\n")
    cluster = ScriptedCluster(str(cfg), tmp_path / "logs")
    cluster.code = code
    return cluster


def test_a_crashing_child_is_restarted_with_its_log_appended(tmp_path: Path) -> None:
    crash = "import sys; print('up', flush=True); sys.exit(3)"
    cluster = scripted(tmp_path, {"prefill": crash}, backoff_s=0.05, max_backoff_s=0.1,
                       max_restarts_per_minute=10)
    said: list[str] = []
    cluster.say = said.append
    try:
        for role, index in (("conductor", 0), ("prefill", 0)):
            cluster.spawn(role, index)
        sleeper = cluster.child("conductor").proc.pid
        cluster.wait_restarted("prefill", 0, timeout_s=10, since=1)
        assert cluster.restarts == {("prefill", 0): 2}  # the sleeping child untouched
        assert cluster.child("conductor").proc.pid == sleeper
        assert [c.name for c in cluster.children] == ["conductor-0", "prefill-0"]
        assert "prefill-0 exited with code 3; restart 1 in 0.05 s" in said
        assert "prefill-0 exited with code 3; restart 2 in 0.1 s" in said
        log = (tmp_path / "logs" / "prefill-0.log").read_text()
        assert log.count("up\n") >= 2
        assert "--- crescent up: restart 1 of prefill-0 (exit code 3)" in log
    finally:
        cluster.stop(grace_s=1)


def test_a_crash_loop_stops_with_a_clear_error(tmp_path: Path) -> None:
    cluster = scripted(tmp_path, {"decode": "import sys; sys.exit(1)"}, backoff_s=0.0,
                       max_restarts_per_minute=2)
    try:
        cluster.spawn("decode", 0)
        deadline = time.monotonic() + 10
        with pytest.raises(ClusterError, match=r"decode-0 exited with code 1: crash loop: "
                                               r"restarted 2 times"):
            while time.monotonic() < deadline:
                cluster.supervise()
                time.sleep(0.02)
        assert cluster.restarts == {("decode", 0): 2}
    finally:
        cluster.stop(grace_s=1)


def test_killed_child_comes_back_in_background_and_stop_ends_supervision(
        tmp_path: Path) -> None:
    cluster = scripted(tmp_path, {}, backoff_s=0.05)
    try:
        first = cluster.spawn("router", 0).proc.pid
        cluster.supervise_in_background(interval_s=0.02)
        cluster.kill("router", 0)
        child = cluster.wait_restarted("router", 0, timeout_s=10, since=0)
        assert child.proc.pid != first and child.proc.poll() is None
    finally:
        cluster.stop(grace_s=1)
    assert child.proc.poll() is not None
    assert cluster.supervise() == []  # a stopped cluster restarts nothing
