"""The fork server (launch/forkserver.py): a forked service runs the same bootstrap as
``python -m services.<role>``, with the environment, working directory, session and log
it was given; the launcher waits on it, signals it and reads its exit status as a child of
its own; a server that died or has threads answers with an error, never a hang."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from launch.forkserver import ForkServer, ForkServerError

REPO = Path(__file__).resolve().parents[2]
CONFIG = "base_port = 24700\nhttp_port = 24690\n"


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    fs = ForkServer()
    yield fs
    fs.close()


def _wait_for(path: Path, text: str, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = path.read_text(errors="replace") if path.exists() else ""
        if text in got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"{text!r} not in {path}: {got[-2000:]}")


def test_a_forked_service_runs_the_bootstrap_in_its_directory_environment_and_session(
        server: ForkServer, tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text(CONFIG)
    log = tmp_path / "store_master-0.log"
    core = min(os.sched_getaffinity(0))
    env = dict(os.environ, CRESCENT_CPUS=str(core))  # a CPU plan (common/cpu.py)
    # a relative --config: found only from the working directory it was given
    proc = server.spawn("store_master", ["--index", "0", "--config", "c.toml"], env,
                        tmp_path, log)
    try:
        text = _wait_for(log, f"bootstrap: store_master-0 (pid {proc.pid}, config c.toml)")
        assert f"store_master: cpu plan applied: cores {core}," in text  # its environment
        assert os.sched_getaffinity(proc.pid) == {core}
        assert proc.poll() is None
        assert os.getsid(proc.pid) == proc.pid  # a session of its own: killpg reaches it
        assert os.getpgid(proc.pid) == proc.pid
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(20) == 0, text  # SIGTERM drains, then a clean stop
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_exit_statuses_are_the_services_own(server: ForkServer, tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("no_such_setting = 1\n")
    bad = server.spawn("store_master", ["--config", str(tmp_path / "bad.toml")],
                       dict(os.environ), REPO, tmp_path / "bad.log")
    assert bad.wait(20) == 2  # a bad config, as from exec
    assert "bad config" in (tmp_path / "bad.log").read_text()

    (tmp_path / "c.toml").write_text(CONFIG)
    live = server.spawn("store_master", ["--config", str(tmp_path / "c.toml")],
                        dict(os.environ), REPO, tmp_path / "live.log")
    _wait_for(tmp_path / "live.log", "bootstrap: store_master-0")
    os.killpg(live.pid, signal.SIGKILL)
    assert live.wait(10) == -signal.SIGKILL
    assert live.poll() == -signal.SIGKILL  # kept once read

    crash = server.spawn("no_such_role", [], dict(os.environ), REPO, tmp_path / "crash.log")
    assert crash.wait(10) == 1
    assert "KeyError: 'no_such_role'" in (tmp_path / "crash.log").read_text()


def test_a_dead_server_is_an_error_not_a_hang(tmp_path: Path) -> None:
    fs = ForkServer()
    fs.proc.kill()
    fs.proc.wait(5)
    started = time.monotonic()
    with pytest.raises(ForkServerError, match="fork server"):
        fs.spawn("store_master", [], dict(os.environ), REPO, tmp_path / "x.log")
    assert time.monotonic() - started < 5


def test_the_server_does_not_fork_with_a_second_thread() -> None:
    code = ("import threading, time\n"
            "from launch.forkserver import ForkServerError, fork_service\n"
            "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
            "try:\n"
            "    fork_service({'role': 'router'})\n"
            "except ForkServerError as exc:\n"
            "    print('refused:', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert "refused: the fork server has 2 threads" in out.stdout, out.stderr


def test_services_forked_at_once_each_get_their_own_pid(server: ForkServer,
                                                        tmp_path: Path) -> None:
    """Two launcher threads asking at once (a supervisor and a test) get one answer each."""
    procs = []

    def ask(i: int) -> None:
        procs.append(server.spawn("no_such_role", [], dict(os.environ), REPO,
                                  tmp_path / f"{i}.log"))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len({p.pid for p in procs}) == 4
    assert [p.wait(10) for p in procs] == [1] * 4


def test_the_server_builds_the_default_model_once_for_the_workers_it_forks() -> None:
    code = ("import os\n"
            "from launch import forkserver\n"
            "forkserver.preload()\n"
            "from common.engine import Engine, EngineConfig\n"
            "from common.engine.engine import _PREBUILT\n"
            "[(_, model, _)] = _PREBUILT.values()\n"
            "print('server threads', forkserver.threads())\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    same = Engine(EngineConfig(num_blocks=8)).model is model\n"
            "    other = Engine(EngineConfig(num_blocks=8, model='dummy-tiny')).model is model\n"
            "    print('shared', same, 'another model shared', other, flush=True)\n"
            "    os._exit(0)\n"
            "os.waitpid(pid, 0)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert "server threads 1\n" in out.stdout, out.stdout + out.stderr
    assert "shared True another model shared False" in out.stdout, out.stdout + out.stderr
