"""A mixture of experts on the CPU (common/model/moe.py): does a decode step cost the
experts its tokens run, not all of them?

Qwen3-30B-A3B's shape (``dummy-qwen3-30b-a3b``: 128 experts of 768, 8 a token; ``--layers``
of its 48 layers and its LM head, random weights quantized at load as ``--quantization``)
beside its dense twin (``dummy-qwen3-a3b-dense``: the same layers with one MLP as wide as
the 8 experts, 6,144: the same multiplies a token), each with float32 inputs on the
quantized kernel and with ``linear_dtype = "int8"``; the mixture also with each expert's
projections a kernel call of their own ("apart"), as before their one grouped call. For
each: the least ms per decode step of ``--rounds`` rounds at context ``--contexts`` and
batch ``--batches`` (the variants in turn; each sequence its own token, so that the rows
route apart), the distinct experts a step of each batch runs per layer, a prompt's
prefill, and the bytes of the weights held. One thread by default (a decode worker's on 2
cores).

    python benchmarks/moe.py [--layers 2] [--batches 1,4,8,16] [--threads 1]

Prints the tables, then one JSON line (``--out`` writes it to a file too).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.decode_step import step_ms  # noqa: E402
from benchmarks.quantized import emit, prefill_s, weight_bytes  # noqa: E402
from common.engine import Engine, EngineConfig  # noqa: E402
from common.model import cpu_linear  # noqa: E402
from common.model.moe import Mixture  # noqa: E402

MOE, DENSE = "dummy-qwen3-30b-a3b", "dummy-qwen3-a3b-dense"
# "apart": the experts' projections a kernel call each, as before their grouped call
# (cpu_linear.ExpertLinears)
VARIANTS = {"moe": dict(model=MOE), "moe apart": dict(model=MOE, apart=True),
            "dense": dict(model=DENSE),
            "moe int8": dict(model=MOE, linear_dtype="int8"),
            "int8 apart": dict(model=MOE, linear_dtype="int8", apart=True),
            "dense int8": dict(model=DENSE, linear_dtype="int8")}


def experts_run(engine: Engine, batch: int, context: int) -> float:
    """The distinct experts a decode step of ``batch`` runs, averaged over its layers."""
    seen: list[int] = []
    route = Mixture.route

    def counting(self: Mixture, x: torch.Tensor):
        weights, chosen = route(self, x)
        seen.append(int(chosen.unique().numel()))
        return weights, chosen

    Mixture.route = counting  # type: ignore[method-assign]
    try:
        step_ms(engine, batch, context, steps=2, distinct=True)
    finally:
        Mixture.route = route  # type: ignore[method-assign]
    return round(statistics.mean(seen), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--quantization", default="q4_0", choices=["q4_0", "q8_0"])
    ap.add_argument("--contexts", default="600")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=256, help="tokens of the timed prefill")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="also write the JSON line here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_linear.quant_kernel() is None:
        sys.exit("the quantized kernel does not run on this CPU (no compiler or no AVX-512)")
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * (max(contexts) + 120) // 16 + 64
    engines = {}
    for name, kw in VARIANTS.items():
        started = time.perf_counter()
        kw = dict(kw)
        apart = kw.pop("apart", False)
        engines[name] = Engine(EngineConfig(num_layers=args.layers, kv_dtype="bfloat16",
                                            quantization=args.quantization,
                                            num_blocks=blocks, **kw))
        for lw in engines[name].model.layers if apart else ():
            lw.mlp.grouped = None
        print(f"{name}: built in {time.perf_counter() - started:.0f} s", flush=True)
    print(f"\n{args.layers} layers, {args.quantization}, {args.threads} thread(s): "
          "ms per decode step")
    print(f"{'context':>8}{'batch':>6}" + "".join(f"{n:>12}" for n in engines)
          + f"{'experts/layer':>15}")
    steps: dict[str, dict[str, float]] = {}
    experts: dict[str, float] = {}
    for context in contexts:
        for batch in batches:
            got: dict[str, list[float]] = {name: [] for name in engines}
            names = list(engines)
            for r in range(args.rounds):  # each round starts with the next variant
                for name in names[r % len(names):] + names[:r % len(names)]:
                    got[name].append(step_ms(engines[name], batch, context, distinct=True))
            key = f"ctx{context}_b{batch}"
            row = steps[key] = {n: round(min(v), 1) for n, v in got.items()}
            experts[key] = experts_run(engines["moe"], batch, context)
            print(f"{context:>8}{batch:>6}" + "".join(f"{row[n]:>12.1f}" for n in engines)
                  + f"{experts[key]:>15}")
    prefill = {name: round(prefill_s(e, args.prompt, args.rounds), 3)
               for name, e in engines.items()}
    sizes = {name: round(weight_bytes(e) / 2**20, 1) for name, e in engines.items()}
    print(f"{f'prefill {args.prompt} s':>14}" + "".join(f"{prefill[n]:>12.3f}" for n in engines))
    print(f"{'weights MiB':>14}" + "".join(f"{sizes[n]:>12.1f}" for n in engines))
    result = {"layers": args.layers, "quantization": args.quantization,
              "threads": args.threads, "steps_ms": steps, "experts_per_layer": experts,
              f"prefill_{args.prompt}_s": prefill, "weights_mib": sizes}
    emit(result, args.out)


if __name__ == "__main__":
    main()
