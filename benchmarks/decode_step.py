"""One CPU decode step of the default model, side by side (issue 27): attention over
gathered, padded K/V (SDPA, the old path) or read in place (the C kernel,
common/model/cpu_attention.py), and the layers' linears in float32 or bfloat16
(``linear_dtype``), each on oneDNN or on Crescent's kernels (common/model/cpu_linear.py;
with bfloat16 linears the lm_head on the bfloat16 kernel too or in float32). One thread
by default, as a decode worker has on 2 cores (``--threads``: torch's, which the kernels
split on); bfloat16 KV; at each context and batch the variants run in turn (a round
starting with the next), three rounds, the least step time of each.

    python benchmarks/decode_step.py [--contexts 128,600] [--batches 1,8,32] [--threads 1]

Prints a table of milliseconds per step, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Iterable, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.engine import DecodeInput, Engine, EngineConfig  # noqa: E402

# the file's Q4_1 weights expanded to float in every variant (benchmarks/quantized.py
# compares them kept quantized)
VARIANTS = {"sdpa/f32-onednn": dict(attention_backend="sdpa"),
            "kernel/f32-onednn": dict(attention_backend="cpu"),
            "kernel/f32": dict(attention_backend="cpu"),
            "kernel/bf16-onednn": dict(attention_backend="cpu", linear_dtype="bfloat16"),
            "kernel/bf16-f32head": dict(attention_backend="cpu", linear_dtype="bfloat16"),
            "kernel/bf16": dict(attention_backend="cpu", linear_dtype="bfloat16")}
# the linears (and the lm_head) on oneDNN, not on Crescent's kernels
ONEDNN = ("sdpa/f32-onednn", "kernel/f32-onednn", "kernel/bf16-onednn")
F32_HEAD = ("kernel/bf16-f32head",)  # the lm_head in float32 (Crescent's float32 kernel)


def make_engine(name: str, blocks: int) -> Engine:
    os.environ["CRESCENT_CPU_LINEAR"] = "0" if name in ONEDNN else "1"
    os.environ["CRESCENT_LM_HEAD_NATIVE"] = "0" if name in F32_HEAD else "1"
    try:
        return Engine(EngineConfig(kv_dtype="bfloat16", num_blocks=blocks, quantization="none",
                                   **VARIANTS[name]))
    finally:
        del os.environ["CRESCENT_CPU_LINEAR"], os.environ["CRESCENT_LM_HEAD_NATIVE"]


def step_ms(engine: Engine, batch: int, context: int, steps: int = 6,
            distinct: bool = False, adapters: Sequence[Optional[str]] = (None,)) -> float:
    """Median step time of ``batch`` sequences around ``context`` tokens (their KV as the
    memory holds it: the step's cost does not depend on the values). ``distinct``: each
    row its own token, another each step (a mixture of experts' rows of one token would
    all route alike); else token 5 in every row. Row i runs on LoRA adapter
    ``adapters[i % len(adapters)]`` (None: the base model)."""
    vocab = engine.model_config.vocab_size
    seqs = [((i * 7919 + 13) % vocab if distinct else 5, context + (i * 7) % 50,
             engine.pool.allocate(engine.blocks_needed(context + 60 + steps)))
            for i in range(batch)]
    times = []
    try:
        for s in range(steps):
            step = [DecodeInput((t + 31 * s) % vocab if distinct else t, p + s, b,
                                adapters[i % len(adapters)])
                    for i, (t, p, b) in enumerate(seqs)]
            started = time.perf_counter()
            engine.decode_step(step)
            times.append(time.perf_counter() - started)
    finally:
        for _, _, blocks in seqs:
            engine.pool.free(blocks)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="128,600")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch's (the kernels split on them)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}")
    res = compare(args, make_engine, VARIANTS)
    print(json.dumps({"threads": args.threads, **res}))


def compare(args: argparse.Namespace, make: Callable[[str, int], Engine],
            variants: Iterable[str]) -> dict[str, dict[str, float]]:
    """An engine of each variant (``make(variant, blocks)``), its step at each of
    ``args.contexts`` and ``args.batches``, the variants in turn, ``args.rounds`` times
    (each round starting with the next):
    a table of the least ms per step, printed and returned (``ctx<context>_b<batch>``)."""
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * (max(contexts) + 120) // 16 + 64
    engines = {name: make(name, blocks) for name in variants}
    rounds = args.rounds
    res: dict[str, dict[str, float]] = {}
    print(f"{'context':>8}{'batch':>6}" + "".join(f"{n:>20}" for n in engines) + "  ms/step")
    for context in contexts:
        for batch in batches:
            got: dict[str, list[float]] = {name: [] for name in engines}
            names = list(engines)
            for r in range(rounds):  # each round starts with the next variant: the first
                for name in names[r % len(names):] + names[:r % len(names)]:  # runs slower
                    got[name].append(step_ms(engines[name], batch, context))
            row = res[f"ctx{context}_b{batch}"] = {n: round(min(v), 1) for n, v in got.items()}
            print(f"{context:>8}{batch:>6}" + "".join(f"{row[n]:>20.1f}" for n in engines))
    return res


if __name__ == "__main__":
    main()
