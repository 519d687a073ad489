"""Start, supervise and stop a whole local Crescent cluster as separate processes.

Used by ``crescent up`` and by the end-to-end tests. Every child gets the same config
file; each one logs to ``<log_dir>/<role>-<index>.log``. Each child also gets its CPU
core set and thread count in its environment (common/cpu.py) and pins itself at start.

Supervision is a step, ``supervise()``, that whoever watches the cluster calls (the
``crescent up`` loop, a test, or ``supervise_in_background``): a child that exited on its
own is started again with the same role, index, CPU plan and log file after the back-off of
launch/supervise.py; one that cannot be kept running raises ``ClusterError``. A cluster
nobody supervises (most tests) leaves a dead child dead.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from common.config import ClusterConfig
from common.cpu import ENV_CPUS, ENV_THREADS, CpuPlan, plan_cores, plan_env
from common.service import parse_overrides
from launch.forkserver import ForkedProcess, ForkServer
from launch.supervise import GiveUp, RestartPolicy

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Child:
    role: str
    index: int
    proc: subprocess.Popen | ForkedProcess
    log_path: Path
    restart_at: Optional[float] = None  # monotonic time of its next start, once it exited

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ClusterError(RuntimeError):
    pass


class LocalCluster:
    def __init__(self, config_path: Optional[str], log_dir: str | Path,
                 overrides: Sequence[str] = (), forkserver: Optional[ForkServer] = None,
                 env: Optional[dict[str, str]] = None) -> None:
        """``overrides``: ``KEY=VALUE`` settings laid over the config file, for every child
        (each gets them as ``--set``). ``forkserver``: fork the children from it
        (launch/forkserver.py: the tests) instead of starting each with ``exec``. ``env``:
        variables every child gets on top of this process's environment."""
        self.config_path = config_path
        self.env = dict(env or {})
        self.forkserver = forkserver
        self.overrides = list(overrides)
        self.config = ClusterConfig.load(config_path, parse_overrides(self.overrides))
        plan_cores(self.plan(), self.config.cpu, os.sched_getaffinity(0))  # fail fast
        self.log_dir = Path(log_dir)
        self.children: list[Child] = []
        self.policy = RestartPolicy(self.config.supervise)
        self.restarts: dict[tuple[str, int], int] = {}  # starts after the first, per child
        self.say: Callable[[str], None] = lambda text: None  # restart notices (crescent up)
        self._lock = threading.RLock()  # supervise() from a background thread and a test
        self._watcher: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self.failure: Optional[ClusterError] = None  # what stopped background supervision
        self.extra_args: dict[tuple[str, int], list[str]] = {}  # e.g. --set for one child

    @property
    def url(self) -> str:
        return f"http://{self.config.address('router')}:{self.config.http_port}"

    def plan(self) -> list[tuple[str, int]]:
        """Start order: the store first (workers connect to it), the router last."""
        c = self.config
        order: list[tuple[str, int]] = []
        if c.store.enabled:
            order.append(("store_master", 0))
            order += [("store_node", i) for i in range(c.store.nodes)]
        order.append(("conductor", 0))
        if c.mode == "colocated":
            order += [("colocated", i) for i in range(c.colocated_workers)]
        else:
            order += [("prefill", i) for i in range(c.prefill_processes)]
            order += [("decode", i) for i in range(c.decode_workers)]
        order += [("router", i) for i in range(c.routers)]
        return order

    def cpu_plan(self, role: str, index: int) -> Optional[CpuPlan]:
        """The cores and threads of one child. The whole start plan is divided at once, so
        a child spawned again later gets the same cores as before."""
        processes = self.plan()
        if (role, index) not in processes:
            processes.append((role, index))
        return plan_cores(processes, self.config.cpu, os.sched_getaffinity(0)).get((role, index))

    def service_args(self, role: str, index: int) -> list[str]:
        """Every role's arguments (common/service.py): its index, the config and settings."""
        args = ["--index", str(index)]
        args += ["--config", str(self.config_path)] if self.config_path else []
        for item in self.overrides:
            args += ["--set", item]
        return args + self.extra_args.get((role, index), [])

    def command(self, role: str, index: int) -> list[str]:
        return [sys.executable, "-m", f"services.{role}"] + self.service_args(role, index)

    def spawn(self, role: str, index: int, note: str = "") -> Child:
        """Start one child (again: it replaces the old entry, and its log goes on)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{role}-{index}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", **self.env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.pop(ENV_CPUS, None)  # never inherit a plan from the launcher's own environment
        env.pop(ENV_THREADS, None)
        plan = self.cpu_plan(role, index)
        if plan is not None:
            env.update(plan_env(plan))
        if note:
            with open(log_path, "ab") as log:
                log.write(f"--- crescent up: {note}\n".encode())
        proc = self._start(role, index, env, log_path)
        child = Child(role, index, proc, log_path)
        old = [i for i, c in enumerate(self.children) if (c.role, c.index) == (role, index)]
        if old:
            self.children[old[0]] = child
        else:
            self.children.append(child)
        return child

    def _start(self, role: str, index: int, env: dict[str, str],
               log_path: Path) -> subprocess.Popen | ForkedProcess:
        """The child's process: forked by the fork server, or started with ``exec``."""
        if self.forkserver is not None:
            return self.forkserver.spawn(role, self.service_args(role, index), env, REPO,
                                         log_path)
        with open(log_path, "ab") as log:
            return subprocess.Popen(self.command(role, index), stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                    start_new_session=True)

    def start(self, timeout_s: float = 120.0) -> None:
        for role, index in self.plan():
            self.spawn(role, index)
            if role == "store_master":
                time.sleep(0.3)  # nodes register with the master at start
        self.wait_ready(timeout_s)

    def check_alive(self) -> None:
        for child in self.children:
            code = child.proc.poll()
            if code is not None:
                raise ClusterError(f"{child.name} exited with code {code}; its log:\n"
                                   f"{child.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if self.healthy():
                return
            time.sleep(0.25)
        raise ClusterError(f"cluster not healthy after {timeout_s:.0f}s; logs in {self.log_dir}")

    # ------------------------------------------------------------ supervision
    def supervise(self, now: Optional[float] = None) -> list[Child]:
        """One step: note the children that exited, start again those whose back-off is
        over; returns the children started. Raises ``ClusterError`` for a child that
        cannot be kept running (a crash loop, a bad config, restarts off)."""
        with self._lock:
            if self._stopping.is_set():
                return []
            now = time.monotonic() if now is None else now
            started = []
            for child in list(self.children):
                if child.restart_at is None:
                    code = child.proc.poll()
                    if code is None:
                        continue
                    decision = self.policy.on_exit(child.name, code, now)
                    if isinstance(decision, GiveUp):
                        raise ClusterError(f"{decision}; its log:\n{child.log_tail()}")
                    child.restart_at = now + decision.delay_s
                    self.say(str(decision))
                if now >= child.restart_at:
                    key = (child.role, child.index)
                    self.restarts[key] = self.restarts.get(key, 0) + 1
                    note = (f"restart {self.restarts[key]} of {child.name} (exit code "
                            f"{child.proc.returncode})")
                    started.append(self.spawn(child.role, child.index, note))
                    self.say(f"{note}: pid {started[-1].proc.pid}")
            return started

    def supervise_in_background(self, interval_s: float = 0.2) -> None:
        """Call ``supervise`` every ``interval_s`` in a thread until ``stop``; a failure
        is kept in ``failure`` (and raised by ``wait_restarted``)."""
        def watch() -> None:
            while not self._stopping.wait(interval_s):
                try:
                    self.supervise()
                except ClusterError as exc:
                    self.failure = exc
                    return

        self._watcher = threading.Thread(target=watch, name="supervise", daemon=True)
        self._watcher.start()

    def child(self, role: str, index: int = 0) -> Child:
        for c in self.children:
            if (c.role, c.index) == (role, index):
                return c
        raise KeyError(f"no child {role}-{index}")

    def wait_restarted(self, role: str, index: int = 0, timeout_s: float = 30.0,
                       since: Optional[int] = None) -> Child:
        """Supervise (unless a background thread does) until ``role-index`` has been
        started more than ``since`` times after its first start (default: as many as now)
        and is running; returns the new child."""
        key = (role, index)
        since = self.restarts.get(key, 0) if since is None else since
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.failure is not None:
                raise self.failure
            if self._watcher is None:
                self.supervise()
            if self.restarts.get(key, 0) > since and self.child(role, index).proc.poll() is None:
                return self.child(role, index)
            time.sleep(0.05)
        raise ClusterError(f"{role}-{index} was not restarted within {timeout_s:g} s")

    def kill(self, role: str, index: int = 0) -> None:
        """Hard-kill one child (failure tests)."""
        for child in self.children:
            if child.role == role and child.index == index and child.proc.poll() is None:
                os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait(5)

    def stop(self, grace_s: Optional[float] = None) -> None:
        """SIGTERM every child (router first), then SIGKILL what is left after ``grace_s``
        (default: the drain timeout of [supervise] and 5 s more)."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(5)
        if grace_s is None:
            grace_s = self.config.supervise.drain_timeout_s + 5.0
        for child in reversed(self.children):
            if child.proc.poll() is None:
                try:
                    os.killpg(child.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for child in self.children:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                child.proc.wait(remaining)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(child.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                child.proc.wait(5)
        self.children.clear()

    def __enter__(self) -> "LocalCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
