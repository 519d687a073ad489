"""Start, watch and stop a whole local Crescent cluster as separate processes.

Used by ``crescent up`` and by the end-to-end tests. Every child gets the same config
file; each one logs to ``<log_dir>/<role>-<index>.log``. Each child also gets its CPU
core set and thread count in its environment (common/cpu.py) and pins itself at start.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from common.config import ClusterConfig
from common.cpu import ENV_CPUS, ENV_THREADS, CpuPlan, plan_cores, plan_env

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Child:
    role: str
    index: int
    proc: subprocess.Popen
    log_path: Path

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
    def __init__(self, config_path: Optional[str], log_dir: str | Path) -> None:
        self.config_path = config_path
        self.config = ClusterConfig.load(config_path)
        plan_cores(self.plan(), self.config.cpu, os.sched_getaffinity(0))  # fail fast
        self.log_dir = Path(log_dir)
        self.children: list[Child] = []

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.http_port}"

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
            order += [("prefill", i) for i in range(c.prefill_workers)]
            order += [("decode", i) for i in range(c.decode_workers)]
        order.append(("router", 0))
        return order

    def cpu_plan(self, role: str, index: int) -> Optional[CpuPlan]:
        """The cores and threads of one child (None: affinity off). The whole start plan is
        divided at once, so a child spawned again later gets the same cores as before."""
        processes = self.plan()
        if (role, index) not in processes:
            processes.append((role, index))
        return plan_cores(processes, self.config.cpu, os.sched_getaffinity(0)).get((role, index))

    def spawn(self, role: str, index: int) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{role}-{index}.log"
        cmd = [sys.executable, "-m", f"services.{role}"]
        cmd += ["--index", str(index)]  # every role: the same arguments (common/service.py)
        cmd += ["--config", str(self.config_path)] if self.config_path else []
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.pop(ENV_CPUS, None)  # never inherit a plan from the launcher's own environment
        env.pop(ENV_THREADS, None)
        plan = self.cpu_plan(role, index)
        if plan is not None:
            env.update(plan_env(plan))
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=REPO, start_new_session=True)
        child = Child(role, index, proc, log_path)
        self.children.append(child)
        return child

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

    def kill(self, role: str, index: int = 0) -> None:
        """Hard-kill one child (failure tests)."""
        for child in self.children:
            if child.role == role and child.index == index and child.proc.poll() is None:
                os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait(5)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every child (router first), then SIGKILL what is left after ``grace_s``."""
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
