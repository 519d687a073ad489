"""What batch invariance costs a prefill step (issue 27): a prompt chunk after a cached
prefix, on the default model in the prefill worker's precision (bfloat16 where the CPU
has it), one thread, as a prefill worker has on 2 cores. Its attention by torch's flash
attention in one part (not batch invariant), in parts cut at multiples of the default
cluster's ``chunk_align()`` (batch invariance without the kernel), or by the CPU kernel
that computes each prompt row alone (common/model/cpu_attention.py: invariant, no parts;
the default where it builds). The engines run in turn, ``--rounds`` rounds, the least
step time of each.

    python benchmarks/attention_parts.py [--prefixes 256,1024] [--chunk 256]

Prints a table of milliseconds per step, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.config import ClusterConfig  # noqa: E402
from common.engine import Engine, EngineConfig  # noqa: E402
from common.engine.config import PrefillChunk  # noqa: E402
from common.worker import native_bfloat16  # noqa: E402


def step_ms(engine: Engine, prefix: int, chunk: int) -> float:
    """One step of ``chunk`` tokens after ``prefix`` cached ones (computed first, in chunks
    of ``chunk``), in milliseconds."""
    ids = [(i * 7919) % 40000 + 10 for i in range(prefix + chunk)]
    table = engine.pool.allocate(engine.blocks_needed(len(ids)))
    try:
        for start in range(0, prefix, chunk):
            engine.step([PrefillChunk(ids, start, min(start + chunk, prefix), table)])
        started = time.perf_counter()
        engine.stage_step([PrefillChunk(ids, prefix, prefix + chunk, table)])
        return (time.perf_counter() - started) * 1e3
    finally:
        engine.pool.free(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefixes", default="256,1024")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    align = ClusterConfig().chunk_align()
    dtype = "bfloat16" if native_bfloat16() else "float32"
    prefixes = [int(p) for p in args.prefixes.split(",")]
    blocks = (max(prefixes) + args.chunk) // 16 + 8
    variants = {"flash, one part": ("sdpa", 0), f"flash, {align}-token parts": ("sdpa", align),
                "kernel": ("cpu", align)}
    engines = {name: Engine(EngineConfig(
        dtype=dtype, kv_dtype="bfloat16", num_blocks=blocks, prefill_chunk=args.chunk,
        chunk_align=a, attention_backend=backend)) for name, (backend, a) in variants.items()}
    res: dict[str, dict[str, float]] = {}
    print(f"{'prefix':>7}{'chunk':>6}" + "".join(f"{n:>22}" for n in engines) +
          f"{'parts/one':>10}{'kernel/one':>11}  ms/step ({dtype}, 1 thread)")
    with torch.inference_mode():
        for prefix in prefixes:
            times: dict[str, list[float]] = {name: [] for name in engines}
            for _ in range(args.rounds):  # in turn: a slower minute slows both
                for name, e in engines.items():
                    times[name].append(step_ms(e, prefix, args.chunk))
            best = {name: min(t) for name, t in times.items()}
            one, parts, kernel = best.values()
            res[str(prefix)] = {**best, "parts_over_one": parts / one,
                                "kernel_over_one": kernel / one}
            print(f"{prefix:>7}{args.chunk:>6}" + "".join(f"{v:>22.1f}" for v in best.values())
                  + f"{parts / one:>10.2f}{kernel / one:>11.2f}")
    print(json.dumps({"bench": "attention_parts", "dtype": dtype, "chunk_align": align,
                      "chunk": args.chunk, "threads": 1, "ms": res}))


if __name__ == "__main__":
    main()
