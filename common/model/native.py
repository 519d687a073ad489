"""The CPU's C kernels (common/model/csrc/*.c): compiled on this machine at first use
(``FLAGS``, about a second) into one library in the cache directory, keyed by the
sources, the compiler and the CPU's flags, and loaded with ctypes, which lets go of the
GIL during a call. A call splits over torch's threads with OpenMP, on torch's own team
(csrc/parallel.c). Without a C compiler ``library()`` is None and its users keep torch's
paths: common/model/cpu_attention.py (paged attention), common/model/cpu_linear.py
(bfloat16 linears for a decode step's few rows).
"""
from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
import platform
import shutil
import subprocess
from typing import Optional

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
OPENMP = "-fopenmp"  # csrc/parallel.c; a compiler without it builds the library without


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
    flags = " ".join((*FLAGS, OPENMP))
    ident = xxhash.xxh3_64(b"|".join([*sources, version.encode(), flags.encode(),
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
    for flags in ((*FLAGS, OPENMP), FLAGS):
        done = subprocess.run([cc, *flags, "-o", tmp, *SOURCES, "-lm"], capture_output=True,
                              text=True, timeout=120)
        if done.returncode == 0:
            break
        if OPENMP in flags:
            log.warning("CPU kernels build without OpenMP (%s): one thread a call",
                        done.stderr.strip()[-300:])
    if done.returncode != 0:
        raise OSError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, path)


@functools.cache
def parallel() -> bool:
    """Whether the kernels' ``*_par`` entry points split over threads (OpenMP, csrc/
    parallel.c); without it they run whole on the calling thread."""
    lib = library()
    return lib is not None and bool(lib.crescent_openmp())


def threads(units: int) -> int:
    """How many of torch's threads a call of ``units`` pieces (output tiles, query rows)
    splits over. On torch's own team even a batch-1 step's projections pay for it (SmolLM2,
    2 threads on 2 cores: 15.9 ms a step against 19.2 with only calls of 4M multiply-adds
    or more split, 18.8 on one thread)."""
    return max(1, min(torch.get_num_threads(), units)) if parallel() else 1
