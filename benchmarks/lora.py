"""What serving LoRA adapters costs a CPU step (common/model/lora.py): the default model as
a decode worker of ``launch/configs/default.toml`` runs it, its rows on the base model, all
on one adapter (rank 16 or 64, every linear of every layer), or spread over four adapters
of rank 16 (each a group of its own: two more kernel calls a fused linear each). At each
context and batch the variants run in turn, ``--rounds`` rounds, the least ms per step;
then a prompt's prefill on the base model and on one adapter. One thread by default (a
decode worker's on 2 cores).

    python benchmarks/lora.py [--contexts 600] [--batches 1,8,32] [--threads 1]

Prints the tables, then one JSON line (``--out`` writes it to a file too).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.decode_step import step_ms  # noqa: E402
from benchmarks.quantized import emit, prefill_s  # noqa: E402
from common.config import ClusterConfig  # noqa: E402
from common.engine import Engine  # noqa: E402
from common.model.dummy_weights import random_adapter  # noqa: E402
from common.worker import engine_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# each variant's rows: row i on adapters[i % len]
VARIANTS = {"base": (None,), "r16": ("r16-0",), "r64": ("r64",),
            "4 x r16": ("r16-0", "r16-1", "r16-2", "r16-3")}


def make_engine(tmp: Path, blocks: int, role: str) -> Engine:
    """The default config's ``role`` engine, serving four adapters of rank 16 and one of 64."""
    config = ClusterConfig.load(str(ROOT / "launch/configs/default.toml"))
    model = Engine(dataclasses.replace(engine_config(config, role), num_blocks=1)).model_config
    modules = tuple((f"r16-{i}", str(random_adapter(tmp / f"r16-{i}", model, 16, seed=i)))
                    for i in range(4)) + (("r64", str(random_adapter(tmp / "r64", model, 64))),)
    return Engine(dataclasses.replace(engine_config(config, role), num_blocks=blocks,
                                      lora_modules=modules, num_threads=None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="600")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512, help="prefill tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="also write the JSON line here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    result: dict = {"threads": args.threads, "decode_ms": {}, "prefill_ms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        blocks = max(batches) * (max(contexts) + 120) // 16 + 64
        engine = make_engine(Path(tmp), blocks, "decode")
        names = list(VARIANTS)
        print(f"decode worker: linear_dtype {engine.config.linear_dtype}, threads "
              f"{args.threads}\n{'context':>8}{'batch':>6}"
              + "".join(f"{n:>18}" for n in names) + "  ms/step (ratio to base)")
        for context in contexts:
            for batch in batches:
                got: dict[str, list[float]] = {n: [] for n in names}
                for r in range(args.rounds):  # each round starts with the next variant
                    for n in names[r % len(names):] + names[:r % len(names)]:
                        got[n].append(step_ms(engine, batch, context, distinct=True,
                                              adapters=VARIANTS[n]))
                row = {n: round(min(v), 2) for n, v in got.items()}
                result["decode_ms"][f"ctx{context}_b{batch}"] = row
                print(f"{context:>8}{batch:>6}" + "".join(
                    f"{row[n]:>10.1f} ({row[n] / row['base']:.2f}x)" for n in names))
        prefill = make_engine(Path(tmp), args.prompt // 16 + 8, "prefill")
        for n in ("base", "r16", "r64"):
            result["prefill_ms"][n] = round(1e3 * prefill_s(prefill, args.prompt, args.rounds,
                                                             VARIANTS[n][0]), 1)
        base = result["prefill_ms"]["base"]
        print(f"prefill of {args.prompt} tokens (prefill worker, dtype {prefill.config.dtype}, "
              f"linear_dtype {prefill.config.linear_dtype}): " + ", ".join(
                  f"{n} {ms:.1f} ms ({ms / base:.2f}x)" for n, ms in result["prefill_ms"].items()))
    emit(result, args.out)


if __name__ == "__main__":
    main()
