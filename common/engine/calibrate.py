"""The cost model fitted on the machine that runs it.

A shipped profile was measured once, on some machine, in some precision; the conductor's
TTFT predictions inherit its error (29-47 % median on the live replay with a profile from
another machine). So a worker times its own engine at its first start on a machine, the
way it will run (its dtypes, threads and cores; prompts in the worker's step chunks; a
decode step of B sequences of K context), fits the polynomials of
common/scheduling/cost.py by least squares, and caches them under the cache directory,
keyed by everything that changes them (``calibration_key``). It reports them at
registration (``RegisterWorker.cost``) and the conductor prices with them; the online
refit (services/conductor/calibration.py) follows what the load does from there.
``crescent calibrate`` measures again (``python -m common.engine.calibrate``).

Only with ``cost_profile = "auto"``; a named profile or a JSON file pins the model.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from common.engine.batching import plan_chunks
from common.engine.config import DecodeInput, PrefillChunk
from common.engine.engine import Engine
from common.model.loader import cache_dir
from common.protocol import MachineCost
from common.scheduling.cost import (DecodeCoefficients, PrefillCoefficients, fit_decode_cost,
                                    fit_prefill_cost)

log = logging.getLogger(__name__)

VERSION = 1  # of what is measured and how: a change re-measures every machine
# (new tokens, cached tokens): one fixed token sequence, so every point after a prefix
# reads the KV one untimed prefill of the longest prefix wrote
PREFILL_GRID = ((8, 0), (32, 0), (96, 0), (192, 0), (384, 0), (640, 0),
                (32, 256), (128, 256), (64, 640), (16, 960))
# (batch, context per sequence) of a decode step; each fits 300 blocks of 16
DECODE_GRID = ((1, 128), (8, 128), (32, 128), (1, 1024), (8, 512), (16, 256))
REPEATS = 2  # the fastest (noise only adds time), after one warm-up
# A phase measures its grid in order until this much time is spent: on a busy machine (a
# test suite's other clusters) it fits fewer points rather than hold the start for minutes
TIME_LIMIT_S = 15.0
# Below this share of its cores' time (CPU time / wall time / threads) the process was
# sharing its cores while it measured: said in the log and the cached file
BUSY_SHARE = 0.8


@dataclass
class _Prompt:
    """What ``plan_chunks`` reads of a prompt: computed so far and left to compute."""
    done: int
    end: int
    aborted: bool = False

    @property
    def remaining(self) -> int:
        return self.end - self.done


def machine_name(device: str) -> str:
    """The GPU's name, or the CPU's model name (``/proc/cpuinfo``)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_key(engine: Engine, phase: str, budget: int) -> dict:
    """Everything a phase's time depends on, besides the load."""
    c = engine.config
    return {"version": VERSION, "phase": phase, "machine": machine_name(c.device),
            "device": c.device, "model": c.model, "dtype": c.dtype,
            "linear_dtype": c.linear_dtype, "kv_dtype": c.kv_dtype,
            "quantized": engine.model.kept_quantized > 0,
            "threads": torch.get_num_threads() if c.device == "cpu" else 0,
            "block_size": c.block_size, "chunk_align": c.chunk_align,
            "attention": _attention_name(engine),
            "budget": budget if phase == "prefill" else 0}


def _attention_name(engine: Engine) -> str:
    """The attention backend, and the CPU kernel's build (a new kernel is re-measured)."""
    kernel = getattr(engine.attention, "kernel", None)
    return type(engine.attention).__name__ + (f" {kernel.name}" if kernel else "")


def key_text(key: dict) -> str:
    return json.dumps(key, sort_keys=True)


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(key_text(key).encode()).hexdigest()[:16]
    return Path(cache_dir()) / "profiles" / f"{key['phase']}-{digest}.json"


def _tokens(engine: Engine, n: int) -> list[int]:
    rng = np.random.default_rng(n)
    vocab = engine.model_config.vocab_size
    return [int(t) for t in rng.integers(10, vocab - 10, size=n)]


def _fastest(engine: Engine, fn: Callable[[], object], repeats: int) -> float:
    cuda = engine.config.device.startswith("cuda")
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _within(grid: Sequence[tuple[int, int]], deadline: float) -> Iterator[tuple[int, int]]:
    """The grid's points in order until ``deadline`` (``time.perf_counter``; the first
    always)."""
    for i, point in enumerate(grid):
        if i and time.perf_counter() > deadline:
            return
        yield point


def prefill_samples(engine: Engine, budget: int, repeats: int = REPEATS,
                    grid: Sequence[tuple[int, int]] = PREFILL_GRID,
                    limit_s: float = TIME_LIMIT_S) -> list[tuple[int, int, float]]:
    """(new, cached, seconds) of the grid's points that fit the context and the KV pool:
    the new tokens in the worker's step chunks (``plan_chunks``), after the prefix. A
    point's prefix is computed when the grid reaches it (extending the last one), and only
    if the prompts' measured speed says it ends within ``limit_s``: an 8B model's 960-token
    prefix took minutes on one core, computed up front, before the first point."""
    fits = [(n, c) for n, c in grid if n + c <= engine.max_context]
    length = max((n + c for n, c in fits), default=0)
    while fits and engine.blocks_needed(length) > engine.pool.num_free:
        fits = [(n, c) for n, c in fits if n + c < length]
        length = max((n + c for n, c in fits), default=0)
    if not fits:
        return []
    ids, align = _tokens(engine, length), engine.config.chunk_align
    table = engine.pool.allocate(engine.blocks_needed(length))
    try:
        engine.prefill(ids[:1], table, 0)  # warm-up
        samples: list[tuple[int, int, float]] = []
        prefix, deadline = 1, time.perf_counter() + limit_s
        for new, cached in _within(fits, deadline):
            if cached > prefix:
                per_token = max((s / n for n, c, s in samples if not c), default=0.0)
                if samples and time.perf_counter() + per_token * (cached - prefix) > deadline:
                    break
                engine.prefill(ids[:cached], table, prefix)
                prefix = cached
            def run() -> None:
                prompt = _Prompt(cached, cached + new)
                while prompt.remaining:
                    [(_, n)] = plan_chunks([prompt], budget, align=align)
                    engine.stage_step([PrefillChunk(ids[:prompt.end], prompt.done,
                                                    prompt.done + n, table)])
                    prompt.done += n

            samples.append((new, cached, _fastest(engine, run, repeats)))
        return samples
    finally:
        engine.pool.free(table)


def decode_samples(engine: Engine, repeats: int = REPEATS,
                   grid: Sequence[tuple[int, int]] = DECODE_GRID,
                   limit_s: float = TIME_LIMIT_S) -> list[tuple[int, int, float]]:
    """(batch, total context, seconds) of one decode step per grid point that fits."""
    fits = [(b, k) for b, k in grid if b <= engine.config.max_batch_size and
            k < engine.max_context and b * engine.blocks_needed(k + 1) <= engine.pool.num_free]
    samples = []
    for batch, context in _within(fits, time.perf_counter() + limit_s):
        tables = [engine.pool.allocate(engine.blocks_needed(context + 1)) for _ in range(batch)]
        try:
            # each row its own token: a mixture of experts' rows of one token would all
            # run the same experts, a fraction of what a real batch runs
            inputs = [DecodeInput(token_id=token, position=context, block_table=t)
                      for token, t in zip(_tokens(engine, batch), tables)]
            engine.decode_step(inputs)  # warm-up (on a GPU: this batch size's graph)
            samples.append((batch, batch * context,
                            _fastest(engine, lambda: engine.decode_step(inputs), repeats)))
        finally:
            for t in tables:
                engine.pool.free(t)
    return samples


def measure(engine: Engine, phases: Sequence[str], budget: int) -> MachineCost:
    """Time and fit ``phases`` ("prefill", "decode") on this engine now."""
    started = time.perf_counter()
    prefill = decode = None
    keys = []
    if "prefill" in phases:
        samples = prefill_samples(engine, budget)
        if len({n for n, _, _ in samples}) >= 3:
            prefill = fit_prefill_cost(samples)
        keys.append(calibration_key(engine, "prefill", budget))
    if "decode" in phases:
        samples = decode_samples(engine)
        if len(samples) >= 3:
            decode = fit_decode_cost(samples)
        keys.append(calibration_key(engine, "decode", budget))
    log.info("calibrated %s on %s in %.1f s", "+".join(phases), machine_name(
        engine.config.device), time.perf_counter() - started)
    return MachineCost(" / ".join(key_text(k) for k in keys), prefill, decode)


def machine_cost(engine: Engine, phases: Sequence[str], budget: int,
                 force: bool = False) -> MachineCost:
    """This engine's cost coefficients for ``phases``: from the cache, or measured now
    (and cached) at the first start on this machine, or with ``force``. Workers of one
    key starting together measure once: the others wait on the lock and read it."""
    parts = [_cached_phase(engine, phase, budget, force) for phase in phases]
    return MachineCost(" / ".join(p.key for p in parts),
                       next((p.prefill for p in parts if p.prefill), None),
                       next((p.decode for p in parts if p.decode), None))


def _cached_phase(engine: Engine, phase: str, budget: int, force: bool) -> MachineCost:
    key = calibration_key(engine, phase, budget)
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force:
            found = _read(path, key)
            if found is not None:
                return found
        log.info("calibrating %s on this machine (%s; first start, cached in %s)",
                 phase, key["machine"], path)
        cpu, wall = time.process_time(), time.perf_counter()
        measured = measure(engine, [phase], budget)
        coefficients = getattr(measured, phase)
        share = (time.process_time() - cpu) / (time.perf_counter() - wall) / key["threads"] \
            if key["threads"] else 1.0
        if share < BUSY_SHARE:  # cached all the same: a restart must not pay it again
            log.warning("calibrating %s had %.0f %% of its cores' time: they were busy, "
                        "so the fit may be slow (the online calibration scales it); "
                        "'crescent calibrate' on a quiet machine measures again",
                        phase, 100 * share)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "cpu_share": round(share, 3),
                                   phase: asdict(coefficients) if coefficients else None},
                                  indent=1))
        tmp.replace(path)
        return MachineCost(key_text(key), **{phase: coefficients})


def _read(path: Path, key: dict) -> Optional[MachineCost]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key:  # another key's digest collided, or an old layout
        return None
    try:
        prefill = PrefillCoefficients(**data["prefill"]) if data.get("prefill") else None
        decode = DecodeCoefficients(**data["decode"]) if data.get("decode") else None
    except TypeError:
        return None
    return MachineCost(key_text(key), prefill, decode)


PHASES = {"prefill": ("prefill",), "decode": ("decode",), "colocated": ("prefill", "decode")}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """One role's calibration in this process (``crescent calibrate`` runs one per role,
    each pinned as the launcher pins that role)."""
    from common.config import ClusterConfig
    from common.cpu import apply_from_env
    from common.service import parse_overrides
    from common.worker import engine_config

    ap = argparse.ArgumentParser(prog="python -m common.engine.calibrate")
    ap.add_argument("--config", help="cluster config (TOML)")
    ap.add_argument("--role", choices=sorted(PHASES), required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--force", action="store_true", help="measure even if cached")
    args = ap.parse_args(argv)
    apply_from_env(args.role, torch_threads=True)
    logging.basicConfig(level="INFO", format="%(message)s")
    config = ClusterConfig.load(args.config, parse_overrides(args.set))
    engine = Engine(engine_config(config, args.role))
    budget = config.step_budget(args.role)
    cost = machine_cost(engine, PHASES[args.role], budget, force=args.force)
    print(json.dumps({"role": args.role, "prefill": asdict(cost.prefill) if cost.prefill
                      else None, "decode": asdict(cost.decode) if cost.decode else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
