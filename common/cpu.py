"""Which CPU cores, and how many threads, each process of a one-host cluster may use.

On a CPU host the roles of a disaggregated cluster share the same cores: left alone, a
prefill burst's intra-op threads run on the cores the decode worker needs and stretch its
steps, which is the very interference disaggregation exists to remove. So the launcher
plans a core set and a thread count per process (``plan_cores``), hands each child its
plan in the environment (``plan_env``), and the child pins itself before it imports
anything heavy (``apply_from_env``, called from ``services/<role>/__main__.py``).

Default split of the N cores the launcher may use (``os.sched_getaffinity(0)``):

* Services (router, conductor, store master and nodes) are mostly idle or waiting on
  sockets. With N >= 4 the last ``max(1, N // 8)`` cores are theirs alone. Below that no
  core can be spared, and they share the decode side's cores rather than the prefill
  side's: a prefill is one long compute burst whose time the conductor predicts for TTFT
  admission, so its core stays exclusive and predictable, while decode runs short steps
  and the router's streaming of one step's tokens overlaps the next step.
* Compute cores (the rest) go ``ceil(C/2)`` to prefill workers and the remainder to
  decode workers when both roles run; a role running alone, or a colocated worker, gets
  all of them. Several workers of one role divide their role's cores into contiguous
  chunks (sharing single cores round-robin when there are fewer cores than workers).
* N == 1: everything shares the one core; there is nothing to isolate.

A worker's torch intra-op thread count defaults to the size of its core set; services get
one thread (they do no tensor math). Explicit core lists ("0-3,8") and thread counts in
the ``[cpu]`` table override one role each; the other roles keep their defaults.

``affinity = false`` pins nothing (every process may run on every core the launcher may
use, and the OS places its threads), but each process keeps its share's thread count:
a prefill and a decode worker that each ran one thread per core of the host would
oversubscribe it, and OpenMP's pools pay for that dearly (two decode loops on 2 cores, 2
threads each: 2.7x the CPU per token of 1 thread each).
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Iterable, Mapping, MutableMapping, Optional, Sequence

COMPUTE_ROLES = ("prefill", "decode", "colocated")
SERVICE_ROLES = ("router", "conductor", "store_master", "store_node")
ENV_CPUS = "CRESCENT_CPUS"        # core list of this process, e.g. "0-3,8"
ENV_THREADS = "CRESCENT_THREADS"  # its intra-op thread count
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # so OpenMP pools start right-sized


class CpuError(ValueError):
    """A core list that cannot be parsed or names cores this process may not use."""


@dataclass
class CpuConfig:
    """The ``[cpu]`` table of a cluster config. Core lists are "auto" or like "0-3,8"."""

    affinity: bool = True  # False: no pinning; the thread counts still apply
    prefill_cores: str = "auto"
    decode_cores: str = "auto"
    colocated_cores: str = "auto"
    service_cores: str = "auto"
    prefill_threads: Optional[int] = None  # None: the size of the worker's core set
    decode_threads: Optional[int] = None
    colocated_threads: Optional[int] = None

    def __post_init__(self) -> None:
        for role in COMPUTE_ROLES + ("service",):
            text = getattr(self, f"{role}_cores")
            if text != "auto":
                parse_cpu_list(text, what=f"cpu.{role}_cores")
        for role in COMPUTE_ROLES:
            n = getattr(self, f"{role}_threads")
            if n is not None and (not isinstance(n, int) or n < 1):
                raise CpuError(f"cpu.{role}_threads must be a positive integer, got {n!r}")

    def threads(self, role: str) -> Optional[int]:
        """The explicit intra-op thread count of a compute role (None: default)."""
        return getattr(self, f"{role}_threads") if role in COMPUTE_ROLES else None


@dataclass(frozen=True)
class CpuPlan:
    cores: tuple[int, ...]  # sorted
    threads: int

    def __str__(self) -> str:
        return f"cores {format_cpu_list(self.cores)}, {self.threads} thread(s)"


def parse_cpu_list(text: str, what: str = "core list") -> tuple[int, ...]:
    """ "0-3,8" → (0, 1, 2, 3, 8); sorted, duplicates dropped. Raises CpuError."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise CpuError(f"{what} {text!r}: {part!r} is not a core or a range "
                           f"like 0-3") from None
        if first < 0 or last < first:
            raise CpuError(f"{what} {text!r}: bad range {part!r}")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def format_cpu_list(cores: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) → "0-3,8" (the inverse of parse_cpu_list)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cores)):
        if run and c != run[-1] + 1:
            out.append(_span(run))
            run = []
        run.append(c)
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def default_pools(available: Sequence[int], roles: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Each role's core pool before it is divided among the role's workers."""
    cores = tuple(sorted(set(available)))
    if not cores:
        raise CpuError("no CPU cores available")
    n = len(cores)
    present = set(roles)
    spare = max(1, n // 8) if n >= 4 else 0
    compute = cores[:n - spare]
    if "prefill" in present and "decode" in present and len(compute) > 1:
        cut = math.ceil(len(compute) / 2)
        prefill, decode = compute[:cut], compute[cut:]
    else:
        prefill = decode = compute
    return {"prefill": prefill, "decode": decode, "colocated": compute,
            "service": cores[n - spare:] if spare else decode}


def share(pool: Sequence[int], position: int, count: int) -> tuple[int, ...]:
    """Worker ``position`` of ``count``'s part of ``pool``: contiguous chunks whose sizes
    differ by at most one (earlier chunks larger), or one shared core when the pool is
    smaller than the number of workers."""
    if not pool:
        raise CpuError("empty core pool")
    if len(pool) < count:
        return (pool[position % len(pool)],)
    size, extra = divmod(len(pool), count)
    start = position * size + min(position, extra)
    return tuple(pool[start:start + size + (1 if position < extra else 0)])


def plan_cores(processes: Sequence[tuple[str, int]], cpu: CpuConfig,
               available: Iterable[int]) -> dict[tuple[str, int], CpuPlan]:
    """The plan of every ``(role, index)`` in ``processes``; with affinity off, each on
    every core of ``available``, with the thread count of its share.

    Raises CpuError when an explicit core list names cores outside ``available``.
    """
    allowed = tuple(sorted(set(available)))
    pools = default_pools(allowed, (role for role, _ in processes))
    for key in pools:
        text = getattr(cpu, f"{key}_cores")
        if text == "auto":
            continue
        wanted = parse_cpu_list(text, what=f"cpu.{key}_cores")
        missing = sorted(set(wanted) - set(allowed))
        if missing:
            raise CpuError(f"cpu.{key}_cores = {text!r} names cores "
                           f"{format_cpu_list(missing)} this process may not use "
                           f"(available: {format_cpu_list(allowed)})")
        pools[key] = wanted
    plans: dict[tuple[str, int], CpuPlan] = {}
    for role, index in processes:
        if role not in COMPUTE_ROLES:
            plans[(role, index)] = CpuPlan(pools["service"], 1)
            continue
        peers = sorted(i for r, i in processes if r == role)
        cores = share(pools[role], peers.index(index), len(peers))
        plans[(role, index)] = CpuPlan(cores, cpu.threads(role) or len(cores))
    if not cpu.affinity:  # the same thread counts, each process on every core
        plans = {key: CpuPlan(allowed, plan.threads) for key, plan in plans.items()}
    return plans


def plan_env(plan: CpuPlan) -> dict[str, str]:
    """The environment variables that carry ``plan`` to a child process."""
    env = {ENV_CPUS: format_cpu_list(plan.cores), ENV_THREADS: str(plan.threads)}
    env.update((name, str(plan.threads)) for name in THREAD_ENV)
    return env


def apply_from_env(name: str, torch_threads: bool,
                   environ: Optional[MutableMapping[str, str]] = None) -> Optional[CpuPlan]:
    """Pin this process to the plan in its environment, if any, and say so on stderr.

    Call first thing in a process (before threads exist: affinity is inherited by threads
    created later, not by those already running). ``torch_threads``: also set torch's
    intra-op threads (and one inter-op thread); otherwise torch, if ever imported, starts
    from the OMP_NUM_THREADS set here.
    """
    env = os.environ if environ is None else environ
    plan = plan_from_env(env)
    if plan is None:
        return None
    try:
        os.sched_setaffinity(0, plan.cores)
    except OSError as exc:
        raise CpuError(f"{name}: cannot pin to cores {format_cpu_list(plan.cores)}: "
                       f"{exc}") from None
    env.update((k, v) for k, v in plan_env(plan).items() if k in THREAD_ENV)
    threads = f"{plan.threads} thread(s)"
    if torch_threads:
        import torch

        torch.set_num_threads(plan.threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # inter-op pool already started; intra-op threads are what matter
        threads = f"{torch.get_num_threads()} torch thread(s)"
    pinned = format_cpu_list(os.sched_getaffinity(0))
    print(f"{name}: cpu plan applied: cores {pinned}, {threads}", file=sys.stderr, flush=True)
    return plan


def plan_from_env(environ: Mapping[str, str]) -> Optional[CpuPlan]:
    """The plan in ``environ`` (None without CRESCENT_CPUS). Raises CpuError."""
    text = environ.get(ENV_CPUS)
    if text is None:
        return None
    cores = parse_cpu_list(text, what=ENV_CPUS)
    raw = environ.get(ENV_THREADS, str(len(cores)))
    try:
        threads = int(raw)
    except ValueError:
        raise CpuError(f"{ENV_THREADS}={raw!r} is not an integer") from None
    if threads < 1:
        raise CpuError(f"{ENV_THREADS} must be positive, got {threads}")
    return CpuPlan(cores, threads)
