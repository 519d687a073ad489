"""py-spy every service process of a live cluster for a while, and say where time goes.

Used by benchmarks/live_replay.py (``--py-spy SECONDS``): once the cluster is up and the
replay runs, each child is recorded with ``py-spy record --format raw --nonblocking``
(collapsed stacks; the target is never paused), and the summary per process is its
busy share (sampled non-idle threads / samples a fully busy thread would give) and the
functions holding the most samples, both the leaf frames and the deepest frames of this
repository's code.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from benchmarks.replay_metrics import top_self_functions

REPO = Path(__file__).resolve().parent.parent
SAMPLE_HZ = 50  # low: six samplers share two cores with the cluster they measure
# py-spy names files relative to sys.path: this repository's frames read "(services/...".
OWN_CODE = tuple(f"({pkg}/" for pkg in ("common", "services", "launch", "traces")) + \
    (str(REPO) + "/",)


def find_py_spy() -> Optional[str]:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.is_file() else shutil.which("py-spy")


class Profiler:
    """``start`` schedules the recordings ``delay_s`` later; ``finish`` waits for them
    (a bounded time) and summarises. ``seconds <= 0`` disables it."""

    def __init__(self, out_dir: Path, seconds: float, delay_s: float) -> None:
        self.out_dir = out_dir
        self.seconds = seconds
        self.delay_s = delay_s
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self.timer: Optional[threading.Timer] = None
        self.lock = threading.Lock()
        self.cancelled = False

    def start(self, targets: list[tuple[str, int]]) -> None:
        if self.seconds <= 0:
            return
        exe = find_py_spy()
        if exe is None:
            print("warning: --py-spy given but py-spy is not installed "
                  "(pip install py-spy); not profiling", file=sys.stderr)
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.timer = threading.Timer(self.delay_s, self._launch, (exe, targets))
        self.timer.daemon = True
        self.timer.start()

    def _launch(self, exe: str, targets: list[tuple[str, int]]) -> None:
        with self.lock:
            if self.cancelled:
                return
            for name, pid in targets:
                path = self.out_dir / f"{name}.txt"
                cmd = [exe, "record", "--pid", str(pid), "--duration", str(int(self.seconds)),
                       "--rate", str(SAMPLE_HZ), "--format", "raw", "--nonblocking",
                       "--output", str(path)]
                log = open(self.out_dir / f"{name}.py-spy.log", "wb")
                self.procs.append((name, subprocess.Popen(cmd, stdout=log,
                                                          stderr=subprocess.STDOUT), path))
                log.close()

    def finish(self) -> dict[str, Any]:
        """Wait for running recordings (they end on their own after ``seconds``); a
        recording not yet started when the replay ended is cancelled."""
        if self.timer is not None:
            self.timer.cancel()
        with self.lock:
            self.cancelled = True
            procs = list(self.procs)
        summary: dict[str, Any] = {}
        for name, proc, path in procs:
            try:
                proc.wait(self.seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if path.is_file():
                summary[name] = summarize_profile(path.read_text(), self.seconds)
        return summary


def summarize_profile(collapsed: str, seconds: float, k: int = 8) -> dict[str, Any]:
    samples = sum(int(line.rpartition(" ")[2]) for line in collapsed.splitlines()
                  if line.rpartition(" ")[2].isdigit())
    return {"samples": samples, "busy": round(samples / (SAMPLE_HZ * seconds), 3),
            "top_leaf": [[f, round(s, 3)] for f, s in top_self_functions(collapsed, k)],
            "top_own": [[f, round(s, 3)]
                        for f, s in top_self_functions(collapsed, k, within=OWN_CODE)]}
