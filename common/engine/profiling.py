"""Opt-in profiles of a worker's engine steps with ``torch.profiler``: where a step's time
goes on the card (kernels, copies) and on the host (launches, waits).

Off unless ``CRESCENT_PROFILE_DIR`` names a directory (``WorkerRuntime`` gives its engine
``from_env``). Then the first ``CRESCENT_PROFILE_STEPS`` steps (default 12) of each label
are profiled: ``Engine.stage_step`` labels a step by its tokens and where its chunks start
(``1648t-after14736``: a 16k prompt's tenth after a prefix from the store). Each writes
``<dir>/<worker>-<n>-<label>.txt``: one summary line (the step's wall time, the host time
of the thread that ran it, the card's kernel and copy time, and their sum over the wall
time: under 1 means the card waited for the host or for a copy on another stream) and the
top operators by device time (a CPU worker: by host time); the first two of each label also
their timeline, ``.json.gz`` in Chrome's trace format (chrome://tracing, Perfetto). A
profiled step runs slower (the profiler's own cost): use it to see where the time goes,
not to time the step.
"""
from __future__ import annotations

import gzip
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

ENV_DIR = "CRESCENT_PROFILE_DIR"
ENV_STEPS = "CRESCENT_PROFILE_STEPS"
TRACES = 2  # per label, the first steps' timelines (Chrome trace format, gzipped)

log = logging.getLogger(__name__)


class StepProfiler:
    """A worker's step profiles (``from_env``); with no directory, a no-op."""

    def __init__(self, directory: Optional[Path], worker: str, steps: int) -> None:
        self.directory = directory
        self.worker = worker
        self.steps = steps
        self.taken: dict[str, int] = {}
        self.written = 0
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls, worker: str) -> "StepProfiler":
        """The profiler ``CRESCENT_PROFILE_DIR`` asks for (without it, off: no cost)."""
        directory = os.environ.get(ENV_DIR)
        steps = int(os.environ.get(ENV_STEPS, "12"))
        if directory:
            log.warning("%s: profiling up to %d steps of each kind into %s (slower steps)",
                        worker, steps, directory)
        return cls(Path(directory) if directory else None, worker, steps)

    @contextmanager
    def step(self, label: str, device: "object") -> Iterator[None]:
        """Profile the enclosed step (one run of the compute thread) if ``label`` has
        profiles left. The thread's stream is synchronized at both ends so that its work
        counts; other streams are not (reads queued before the step run on under it)."""
        if self.directory is None or self.taken.get(label, 0) >= self.steps:
            yield
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.taken[label] = self.taken.get(label, 0) + 1
        cuda = getattr(device, "type", "cpu") == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.current_stream(device).synchronize()
        wall, host = time.perf_counter(), time.thread_time()
        with profile(activities=activities) as prof:
            yield
            if cuda:
                torch.cuda.current_stream(device).synchronize()
        wall, host = time.perf_counter() - wall, time.thread_time() - host
        self.written += 1
        self._write(prof, label, wall, host)

    def _write(self, prof: "object", label: str, wall: float, host: float) -> None:
        from torch.autograd import DeviceType

        events = prof.key_averages()  # type: ignore[attr-defined]
        key = "self_device_time_total"  # older torch: self_cuda_time_total
        if events and not hasattr(events[0], key):
            key = "self_cuda_time_total"
        # the card's own events (kernels, copies): an operator's row repeats its kernels'
        device = sum(getattr(e, key) for e in events if e.device_type != DeviceType.CPU) / 1e6
        head = (f"{self.worker} step {self.written} ({label}): wall {wall * 1e3:.2f} ms, "
                f"host thread {host * 1e3:.2f} ms, device {device * 1e3:.2f} ms "
                f"(device / wall {device / wall:.2f})\n")
        assert self.directory is not None
        path = self.directory / f"{self.worker}-{self.written:02d}-{label}.txt"
        order = key if device > 0 else "self_cpu_time_total"  # a CPU worker: host time
        path.write_text(head + events.table(sort_by=order, row_limit=30) + "\n")
        if self.taken[label] <= TRACES:  # the timeline too: streams, gaps, overlaps
            trace = path.with_suffix(".json")
            prof.export_chrome_trace(str(trace))  # type: ignore[attr-defined]
            with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            trace.unlink()
        log.warning("profiled: %s", head.strip())
