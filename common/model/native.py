"""The CPU's C kernels (common/model/csrc/*.c): compiled on this machine at first use
(``FLAGS``, about a second) into one library in the cache directory, keyed by the
sources, the compiler and the CPU's flags, and loaded with ctypes, which lets go of the
GIL during a call. Without a C compiler ``library()`` is None and its users keep torch's
paths: common/model/cpu_attention.py (paged attention), common/model/cpu_linear.py
(bfloat16 linears for a decode step's few rows).
"""
from __future__ import annotations

import ctypes
import functools
import glob
import logging
import math
import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch
import xxhash

from common.model.loader import cache_dir

log = logging.getLogger(__name__)

SOURCES = tuple(sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                              "csrc", "*.c"))))
# -ffast-math's reassociation (the dot products vectorise), not all of it: linked with
# -ffast-math a library sets flush-to-zero for its whole process as it loads.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-fPIC", "-shared")


@functools.cache
def library() -> Optional[ctypes.CDLL]:
    """The compiled kernels, built on first use; None where they cannot be (logged once)."""
    try:
        path = library_path()
        if not os.path.isfile(path):
            _build(path)
        return ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernels unavailable (%s): attention gathers each sequence's KV and "
                    "linears run on oneDNN instead (slower)", exc)
        return None


def library_path() -> str:
    cc = shutil.which(os.environ.get("CC", "cc")) or ""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout if cc else ""
    except (OSError, subprocess.SubprocessError):
        version = ""
    sources = []
    for name in SOURCES:
        with open(name, "rb") as f:
            sources.append(f.read())
    ident = xxhash.xxh3_64(b"|".join([*sources, version.encode(), " ".join(FLAGS).encode(),
                                      _cpu_flags().encode(), platform.machine().encode()]))
    return os.path.join(cache_dir(), "kernels", f"crescent-{ident.hexdigest()}.so")


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` code runs only where they all are)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build(path: str) -> None:
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"  # workers may build at once; the rename is atomic
    done = subprocess.run([cc, *FLAGS, "-o", tmp, *SOURCES, "-lm"], capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        raise OSError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, path)


# A call is split over a pool of threads only from POOL_MIN_THREADS torch threads: with 2
# threads on 2 cores the split was no faster (paged attention: 214 vs 231 ms a step at
# batch 32, context 600), torch's OpenMP workers spinning beside it.
POOL_MIN_THREADS = 4
_pool: Optional[ThreadPoolExecutor] = None
_pool_size = 0


def split(run: Callable[[int, int], None], n: int, grain: int) -> None:
    """``run(first, last)`` over [0, n), in pieces of whole ``grain``s on a pool of up to
    torch's thread count where that pays, else at once on this thread."""
    threads = min(torch.get_num_threads(), n // grain)
    if threads < max(2, POOL_MIN_THREADS):
        run(0, n)
        return
    step = math.ceil(n / threads / grain) * grain
    _run_all([functools.partial(run, s, min(s + step, n)) for s in range(0, n, step)])


def each(run: Callable[[int, int], None], parts: int) -> None:
    """``run(part, parts)`` for part in [0, parts), on a pool of ``parts`` threads (this
    one runs part 0)."""
    if parts < 2:
        run(0, 1)
        return
    _run_all([functools.partial(run, p, parts) for p in range(parts)])


def _run_all(calls: list[Callable[[], None]]) -> None:
    """The calls at once, the first on this thread, the others on the pool."""
    global _pool, _pool_size
    if _pool_size < len(calls) - 1:  # more threads than at the last split
        if _pool is not None:
            _pool.shutdown(wait=False)
        _pool = ThreadPoolExecutor(len(calls) - 1, thread_name_prefix="crescent-native")
        _pool_size = len(calls) - 1
    futures = [_pool.submit(call) for call in calls[1:]]
    calls[0]()
    for f in futures:
        f.result()
