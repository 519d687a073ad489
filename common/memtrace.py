"""Where a live process's Python memory grows: tracemalloc, on request.

Off unless the environment sets ``CRESCENT_TRACEMALLOC=N`` (frames kept per allocation,
1-100); then nothing is installed and nothing costs. When it is set, the bootstrap
(common/service.py) starts tracemalloc before it imports the role's module, and each
``SIGUSR2`` the process gets then takes a snapshot:

1. the first is the baseline (send it after warm-up);
2. every later one is compared with the baseline, and the top growth sites (by line, then
   by traceback) are written to ``<CRESCENT_TRACEMALLOC_DIR>/<role>-<index>.tracemalloc.txt``
   (the current directory without it), replacing the file atomically.

The report's first line says how much Python memory tracemalloc traces and the process's
resident memory, both at the baseline and now: RSS growing while the traced memory stays
flat is native growth (torch, glibc's arenas) that tracemalloc does not see. tracemalloc
slows a process and adds to its RSS, so RSS verdicts come from runs without it.
benchmarks/soak.py ``--tracemalloc`` drives this.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

log = logging.getLogger("crescent.memtrace")

ENV_FRAMES = "CRESCENT_TRACEMALLOC"
ENV_DIR = "CRESCENT_TRACEMALLOC_DIR"
SUFFIX = ".tracemalloc.txt"
TOP = 10
SHOWN_FRAMES = 6  # of each traceback in the report, innermost first
_IGNORED = (tracemalloc.__file__, "<frozen importlib._bootstrap>",
            "<frozen importlib._bootstrap_external>", "<unknown>")
MiB = 1024 * 1024


def frames_from_env(env: Mapping[str, str]) -> Optional[int]:
    """The frame count ``CRESCENT_TRACEMALLOC`` asks for; None: off (unset, empty or 0)."""
    text = env.get(ENV_FRAMES, "").strip()
    if not text or text == "0":
        return None
    frames = int(text)  # a ValueError for a bad value: the bootstrap reports a bad config
    if not 1 <= frames <= 100:
        raise ValueError(f"{ENV_FRAMES}={text}: expected 0-100 frames")
    return frames


def rss_mb(pid: int | str = "self") -> Optional[float]:
    """Resident memory of ``pid`` in MiB (None: the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class Mark:
    snapshot: tracemalloc.Snapshot
    traced_mb: float
    rss_mb: float


def mark() -> Mark:
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, name) for name in _IGNORED])
    return Mark(snap, tracemalloc.get_traced_memory()[0] / MiB, rss_mb() or 0.0)


def report(base: Mark, now: Mark, top: int = TOP) -> str:
    """The growth from ``base`` to ``now``: a summary line, then the ``top`` sites by line
    and by traceback (its innermost ``SHOWN_FRAMES``), largest growth first."""
    lines = [f"traced {base.traced_mb:.1f} -> {now.traced_mb:.1f} MB "
             f"({now.traced_mb - base.traced_mb:+.1f}); "
             f"rss {base.rss_mb:.1f} -> {now.rss_mb:.1f} MB ({now.rss_mb - base.rss_mb:+.1f})",
             "", f"top {top} by line:"]
    for stat in now.snapshot.compare_to(base.snapshot, "lineno")[:top]:
        frame = stat.traceback[0]
        lines.append(f"  {stat.size_diff / 1024:+10.1f} KiB {stat.count_diff:+8d} blocks  "
                     f"{frame.filename}:{frame.lineno}")
    lines += ["", f"top {top} by traceback (most recent call first):"]
    for stat in now.snapshot.compare_to(base.snapshot, "traceback")[:top]:
        lines.append(f"  {stat.size_diff / 1024:+10.1f} KiB {stat.count_diff:+8d} blocks")
        lines += [f"    {text.strip()}" for text in stat.traceback.format(
            limit=SHOWN_FRAMES, most_recent_first=True) if text.strip().startswith("File")]
    return "\n".join(lines) + "\n"


class MemTrace:
    """The baseline and the report file of one process (see the module doc)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.baseline: Optional[Mark] = None

    def on_signal(self) -> None:
        now = mark()
        if self.baseline is None:
            self.baseline = now
            log.info("tracemalloc baseline: %.1f MB traced, rss %.1f MB", now.traced_mb,
                     now.rss_mb)
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(report(self.baseline, now))
        os.replace(tmp, self.path)
        log.info("tracemalloc growth sites written to %s", self.path)


def start(name: str, env: Mapping[str, str] = os.environ) -> Optional[MemTrace]:
    """Start tracemalloc if ``env`` asks for it (``name``: the report's ``<role>-<index>``);
    None and nothing started otherwise. Raises ValueError for a bad frame count."""
    frames = frames_from_env(env)
    if frames is None:
        return None
    tracemalloc.start(frames)
    out = Path(env.get(ENV_DIR) or ".")
    out.mkdir(parents=True, exist_ok=True)
    return MemTrace(out / f"{name}{SUFFIX}")


def install(trace: Optional[MemTrace], loop: asyncio.AbstractEventLoop) -> None:
    """Answer SIGUSR2 on ``loop`` with ``trace.on_signal`` (nothing if tracing is off)."""
    if trace is not None:
        loop.add_signal_handler(signal.SIGUSR2, trace.on_signal)
